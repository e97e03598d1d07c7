"""The README's curl and openai-SDK calls (its cluster path, after the port-forward) run unchanged against
a real server serving under the name they ask for; only localhost:8000 becomes the test server's port."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess

import pytest
from pagoda.server.api.state import ServerConfig
from support.readme_cluster_path import blocks, command

MODEL = "SmolLM2-135M-Instruct"  # the name the README's example serves under


@pytest.fixture(scope="module")
def readme_server(start_server):
    return start_server(ServerConfig(served_model_name=MODEL))


def local(text: str, server) -> str:
    assert "localhost:8000" in text
    return text.replace("http://localhost:8000", server.url).replace("localhost:8000", server.url)


def test_the_curl_call_answers(readme_server):
    (curl,) = command("curl")
    done = subprocess.run(shlex.split(local(shlex.join(curl), readme_server)), capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    reply = json.loads(done.stdout)
    assert reply["object"] == "chat.completion" and reply["model"] == MODEL
    assert reply["choices"][0]["message"]["role"] == "assistant"


def test_the_sdk_snippet_runs(readme_server):
    (snippet,) = blocks("python")
    printed, namespace = io.StringIO(), {}
    with contextlib.redirect_stdout(printed):
        exec(compile(local(snippet, readme_server), "README.md", "exec"), namespace)
    reply = namespace["reply"]
    assert reply.model == MODEL and reply.choices[0].message.role == "assistant"
    assert printed.getvalue() == f"{reply.choices[0].message.content}\n"
