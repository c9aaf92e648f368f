"""--api_key: every /v1/ route needs the key as a Bearer token, else OpenAI's 401 error JSON;
/health and /metrics stay open. Through the official openai client and raw httpx, with a fake
engine behind the app."""

import httpx
import openai
import pytest

from fake_engine import MODEL, served
from serve_client import CHAT, GOOD_CHAT, HELLO, metric

KEY = "sk-local-0123456789"


@pytest.fixture(scope="module")
def server(llama2_tokenizer):
    with served(llama2_tokenizer, api_key=KEY) as s:
        yield s


def keyed(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_missing_or_wrong_key_is_a_401_then_the_right_key_works(server, headers):
    refused = metric(server.url, "llama_tp_requests_refused_total", status="401")
    for response in (httpx.post(f"{server.url}{CHAT}", json=GOOD_CHAT, headers=headers),
                     httpx.get(f"{server.url}/v1/models", headers=headers)):
        assert response.status_code == 401
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
        assert "Authorization: Bearer" in error["message"]
    assert metric(server.url, "llama_tp_requests_refused_total", status="401") == refused + 2
    answer = keyed(server.url, KEY).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    assert answer.choices[0].message.content


def test_the_openai_client_with_a_wrong_key(server):
    with pytest.raises(openai.AuthenticationError, match="wrong API key"):
        keyed(server.url, "nope").chat.completions.create(model=MODEL, messages=HELLO)
    with pytest.raises(openai.AuthenticationError):
        keyed(server.url, "nope").models.list()
    assert [model.id for model in keyed(server.url, KEY).models.list()] == [MODEL]


def test_health_and_metrics_stay_open(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
