"""OpenAI's Responses API (POST /v1/responses), served by the chat machinery underneath: a request
body and its input items (protocol.py) become a chat request over the conversation so far
(prepare.py), whose answer goes out as a Response object or its stream of events (output.py), and
is kept for a later request's previous_response_id (store.py). (serve/responses.py writes the
chat completions' and completions' answers.)
"""
