"""The official `openai` Python client against `tandem serve` on loopback.

Usage: python3 tests/serve/openai_client.py TANDEM_BINARY

Starts the server (real SmolLM2 + committed head, CPU), then: a completion, a chat, a
streamed chat (its deltas must join to the non-streamed text), greedy chat output equal to
`tandem generate --chat --draft` and to target-only `tandem generate --chat`, a bad request
refused with the field named, and SIGTERM stopping the server cleanly. Exits non-zero with the
reason on any failure.
"""

import re
import signal
import subprocess
import sys
import time

import openai

HEAD = "heads/smollm2-135m-eagle3"
MODEL_DIR = "models/SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 16


def main(binary: str) -> None:
    server = subprocess.Popen(
        [binary, "serve", "--port", "0", "--max-batch", "4", "--context", "512",
         "--served-model-name", "smollm2", "--model", MODEL_DIR, "--draft", HEAD,
         # every round drafts (the adaptive policy may choose plain rounds on this CPU)
         "--speculation", "fixed"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url = None
        for line in server.stdout:
            print("server:", line.rstrip())
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server did not print its address"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        models = client.models.list()
        assert [m.id for m in models.data] == ["smollm2"], models

        completion = client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
        assert completion.choices[0].text.strip(), completion
        assert completion.usage.completion_tokens >= 1, completion.usage

        chat = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS, temperature=0)
        text = chat.choices[0].message.content
        assert chat.choices[0].finish_reason in ("stop", "length"), chat
        extra = chat.model_extra or {}
        assert extra.get("tandem", {}).get("rounds", 0) >= 1, extra
        print("chat:", repr(text), "tandem:", extra.get("tandem"))

        pieces = []
        for chunk in client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                max_tokens=MAX_TOKENS, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        assert "".join(pieces) == text, ("".join(pieces), text)

        for draft in (["--draft", HEAD], []):
            cli = subprocess.run(
                [binary, "generate", "--model", MODEL_DIR, "--chat", "--prompt", QUESTION,
                 "--max-tokens", str(MAX_TOKENS), *draft],
                capture_output=True, text=True, check=True)
            generated = cli.stdout[:-1] if cli.stdout.endswith("\n") else cli.stdout
            assert generated == text, (draft, generated, text)

        try:
            client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "x"}], temperature=9)
            raise AssertionError("temperature 9 was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "temperature", e.body

        try:
            client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
            raise AssertionError("an unknown model was accepted")
        except openai.NotFoundError as e:
            assert e.body["param"] == "model", e.body

        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=30)
        print(rest)
        assert server.returncode == 0, f"exit code {server.returncode}"
        assert "stopped" in rest, rest
        print("openai client test: ok")
    finally:
        if server.poll() is None:
            server.kill()


if __name__ == "__main__":
    main(sys.argv[1])
