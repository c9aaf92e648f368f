"""The library's log: rank 0 alone by default, every rank marked with LLAMA_TP_LOG_RANKS=all, the
level from LLAMA_TP_LOG, and a clear refusal of a level logging does not know. Both variables are
read when llama_tp is imported; here the same set-up runs again under each environment."""

import logging

import pytest

from llama_tp import logs


@pytest.fixture
def configure(monkeypatch):
    """configure(**environment): the llama_tp logger set up afresh as the import does under it."""
    handlers, level = list(logs.logger.handlers), logs.logger.level

    def configure(**environment) -> None:
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        logs.logger.handlers.clear()
        monkeypatch.setattr(logs, "_rank_filter", logs._RankFilter())
        logs._configure()

    yield configure
    logs.logger.handlers[:] = handlers
    logs.logger.setLevel(level)


def say(rank, capsys) -> str:
    """What the log shows of one info and one warning line, on rank (None: before parallel.init)."""
    logs.set_rank(rank)
    logs.logger.info("loading")
    logs.logger.warning("slow disk")
    return capsys.readouterr().err


def test_rank_0_alone_logs_by_default(configure, capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_TP_LOG_RANKS", raising=False)
    monkeypatch.delenv("LLAMA_TP_LOG", raising=False)
    configure()
    assert say(None, capsys) == "loading\nslow disk\n"
    assert say(0, capsys) == "loading\nslow disk\n"
    assert say(1, capsys) == ""


def test_every_rank_logs_marked_with_its_rank_when_asked(configure, capsys):
    configure(LLAMA_TP_LOG_RANKS="all", LLAMA_TP_LOG="info")
    assert say(0, capsys) == "[rank 0] loading\n[rank 0] slow disk\n"
    assert say(1, capsys) == "[rank 1] loading\n[rank 1] slow disk\n"
    assert say(None, capsys) == "loading\nslow disk\n"


def test_the_level_silences_progress_lines(configure, capsys):
    configure(LLAMA_TP_LOG="warning", LLAMA_TP_LOG_RANKS="0")
    assert say(0, capsys) == "slow disk\n"
    configure(LLAMA_TP_LOG="DEBUG")
    logs.logger.debug("reused 12 tokens")
    assert capsys.readouterr().err == "reused 12 tokens\n"
    assert logs.logger.level == logging.DEBUG


def test_an_unknown_level_is_refused_by_name(configure):
    with pytest.raises(ValueError, match=r"LLAMA_TP_LOG='loud' is not a logging level; use debug, info, warning or "
                                         r"error"):
        configure(LLAMA_TP_LOG="loud")
