"""The serving benchmark's requests: the prompts its clients cycle through, and the two ways they sample."""

SAMPLINGS = {
    "greedy": {"temperature": 0, "repetition_penalty": 1.0},
    "sampled": {"temperature": 0.7},  # the rest is the server's (the model's) own
}

# (prompt, share of --max_tokens): short questions with short answers, explanations, a story, and
# long texts to summarise or answer, so that prompts and answers both differ in length.
PROMPTS: tuple[tuple[str, float], ...] = (
    ("What is the capital of France?", 0.25),
    ("Explain in simple terms how a refrigerator keeps food cold.", 1.0),
    ("Write a haiku about autumn leaves.", 0.25),
    ("Give me three tips for sleeping better.", 0.5),
    ("Write a short story about a robot who learns to paint.", 1.0),
    ("Summarise this paragraph in two sentences:\n\nThe city council met on Tuesday evening to discuss the "
     "proposed changes to the downtown parking rules. Several shop owners spoke against the plan, saying that "
     "shorter parking limits would drive customers to the shopping centre outside town. Residents of the old "
     "quarter, on the other hand, welcomed the proposal, because visitors often leave their cars in residential "
     "streets for the whole day. The council's transport officer presented figures showing that the two large "
     "car parks near the station are rarely more than half full, even on Saturdays. After a long debate, the "
     "council agreed to try the new rules for six months, to add signs pointing drivers to the car parks, and to "
     "review the effect on local businesses at the end of the trial.", 0.5),
    ("Translate 'Where is the train station?' into Spanish, French and German.", 0.25),
    ("What are the pros and cons of working from home?", 1.0),
    ("How do I make a cup of pour-over coffee?", 0.5),
    ("Why is the sky blue?", 0.5),
    ("Help me reply politely to this email:\n\nHi, I hope you are well. I wanted to ask whether you could send "
     "me the slides from last week's meeting, and whether the next meeting is still planned for Thursday at ten. "
     "Some of the team will be travelling that week, so we might need to move it to Friday or to the week after. "
     "Could you also remind me who is preparing the budget summary? Thanks a lot, Maria", 0.5),
    ("List the planets of the solar system in order from the sun.", 0.25),
)
