"""launch/serve.py with an API key and TLS for real: torchrun jobs of 1 and 3 processes serving a
tiny model. A wrong or missing key is OpenAI's 401 at both world sizes, the right one answers;
the key comes from --api_key or LLAMA_TP_API_KEY; with --ssl_certfile/--ssl_keyfile it speaks
HTTPS only."""

import runpy
import subprocess

import httpx
import openai
import pytest

from demo_server import LaunchedServer
from test_serve_launch import LLAMA3_TOKENIZER, MODEL, checkpoints  # noqa: F401 (a fixture)
from torchrun import LAUNCH

pytestmark = pytest.mark.slow

KEY = "sk-test-key"


def self_signed(folder) -> tuple[str, str]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


def assert_key_needed(url: str, verify=True) -> None:
    http = httpx.Client(verify=verify)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = http.post(f"{url}/v1/chat/completions", headers=headers,
                             json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert http.get(f"{url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, http_client=http)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("nproc", [1, 3])
def test_wrong_or_missing_key_is_401_at_world_sizes_1_and_3(checkpoints, tmp_path, nproc):  # noqa: F811
    server = LaunchedServer(checkpoints[nproc], LLAMA3_TOKENIZER, MODEL, tmp_path / "serve.log", nproc,
                            "--max_seq_len", "128", "--max_batch_size", "2", "--api_key", KEY)
    try:
        assert_key_needed(server.url)
    finally:
        server.close()


def test_https_with_the_key_from_the_environment(checkpoints, tmp_path):  # noqa: F811
    cert, key = self_signed(tmp_path)
    server = LaunchedServer(checkpoints[1], LLAMA3_TOKENIZER, MODEL, tmp_path / "serve.log", 1, "--max_seq_len",
                            "128", "--ssl_certfile", cert, "--ssl_keyfile", key, env={"LLAMA_TP_API_KEY": KEY},
                            scheme="https")
    try:
        assert_key_needed(server.url, verify=cert)
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not spoken
            httpx.get(server.url.replace("https", "http") + "/health")
    finally:
        server.close()


def test_tls_files_that_are_no_pair_are_refused_before_loading(tmp_path):
    """A certificate that is not one, or a key of another certificate: one line naming both files,
    checked before the model loads (the HTTP process would only find it after its imports)."""
    check_tls = runpy.run_path(str(LAUNCH / "serve.py"), run_name="serve_script")["_check_tls"]
    cert, key = self_signed(tmp_path)
    check_tls(cert, key)
    (tmp_path / "other").mkdir()
    other_cert, _ = self_signed(tmp_path / "other")
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("not a certificate\n")
    for wrong_cert, wrong_key in ((str(not_pem), key), (other_cert, key)):
        with pytest.raises(ValueError, match=rf"^--ssl_certfile {wrong_cert} and --ssl_keyfile {wrong_key} are not "
                                             r"a PEM certificate and its private key \(.+\); pass the server's own pair$"):
            check_tls(wrong_cert, wrong_key)
