"""`tandem serve` with tensor-parallel decode workers on CPU end to end: one prefill worker
(TP 1) and two decode workers at `--decode-tensor-parallel-size 2`, each a Ray placement group
of two rank actors (gloo), a tiny random Llama with SmolLM2's tokenizer. The prompt's KV goes
from the one-device prefill worker to a two-rank decode worker over a real TCP pair channel.
Completions equal transformers' greedy text; a decode worker's rank process killed mid-stream
takes its worker down (it ends its process: the controller marks it dead) and the streams it
carried resume on the other decode worker, with the same text."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from cli_process import CliProcess, free_port

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("ray")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 120
PROMPTS = ["The river runs past the mill", "A lantern in the harbor"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    """A random 2-layer Llama (4 heads, 2 KV heads) over SmolLM2's tokenizer."""
    import torch
    from hf_oracle import tiny_config

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**tiny_config(vocab_size=49152))
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-tok")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(smollm2_dir) / name).is_file():
            shutil.copy(Path(smollm2_dir) / name, path / name)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    from hf_oracle import hf_greedy_ids

    expected = [
        tok.decode(hf_greedy_ids(model, tok(p)["input_ids"], MAX_TOKENS), skip_special_tokens=True)
        for p in PROMPTS
    ]
    return str(path), expected


@pytest.fixture(scope="module")
def server(tiny_dir):
    path, _ = tiny_dir
    port = free_port()
    env = {**os.environ, "TANDEM_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = ["serve", "--model", path, "--device", "cpu", "--port", str(port)]
    args += ["--prefill", "1", "--decode", "2", "--decode-tensor-parallel-size", "2"]
    args += ["--shutdown-timeout", "3"]
    proc = CliProcess(args, env)
    try:
        proc.wait_for(r"^serving http://", 300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        yield proc, client
    finally:
        proc.stop()


def _complete(client, prompt: str, stream: bool = False):
    return client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )


def test_completions_equal_transformers(server, tiny_dir):
    _, client = server
    _, expected = tiny_dir
    assert [_complete(client, p).choices[0].text for p in PROMPTS] == expected


def test_status_shows_each_workers_ranks(server, capsys):
    """`tandem status` lists each TP worker once, with its two ranks: rank 0 the worker's own
    process, rank 1 a rank actor's, both on the CPU; the prefill worker has one."""
    import json

    from cluster.cli import main

    _, client = server
    port = str(client.base_url.port)
    assert main(["status", "--serve-port", port, "-o", "json", "--timeout", "60"]) == 0
    workers = {w["name"]: w for w in json.loads(capsys.readouterr().out)["workers"]}
    assert sorted(workers) == ["decode-0", "decode-1", "prefill-0"]
    rank_pids = set(_rank_pids())
    for name in ("decode-0", "decode-1"):
        w = workers[name]
        assert [r["rank"] for r in w["ranks"]] == [0, 1]
        assert w["ranks"][0]["pid"] == w["pid"] and w["ranks"][1]["pid"] in rank_pids
        assert {r["device"] for r in w["ranks"]} == {"cpu"}
    assert [r["rank"] for r in workers["prefill-0"]["ranks"]] == [0]
    assert main(["status", "--serve-port", port, "--timeout", "60"]) == 0
    rows = {row.split()[1]: row.split() for row in capsys.readouterr().out.splitlines()[2:]}
    assert [rows[f"decode-{i}"][4:6] for i in (0, 1)] == [["cpu", "x2"]] * 2
    assert rows["prefill-0"][4] == "cpu"  # one device: no count


def _rank_pids() -> list[int]:
    """The rank actors' processes (Ray titles them ``ray::RankActor.run``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"ray::RankActor"):
                pids.append(int(entry.name))
    return pids


def _status(client, capsys) -> dict[str, dict]:
    """`tandem status -o json`'s workers by name."""
    import json

    from cluster.cli import main

    port = str(client.base_url.port)
    assert main(["status", "--serve-port", port, "-o", "json", "--timeout", "60"]) == 0
    return {w["name"]: w for w in json.loads(capsys.readouterr().out)["workers"]}


def test_rank_killed_mid_stream_worker_dies_streams_resume(server, tiny_dir, capsys):
    """The rank actor of a decode worker that carries a stream is killed: the worker dies,
    its streams resume whole on the other decode worker (a new prefill, its KV into the other
    TP-2 worker), and afterwards no live worker holds a block or a request."""
    proc, client = server
    _, expected = tiny_dir
    texts = [""] * len(PROMPTS)
    started = threading.Barrier(len(PROMPTS) + 1)

    def read(i: int) -> None:
        first = True
        for chunk in _complete(client, PROMPTS[i], stream=True):
            texts[i] += chunk.choices[0].text
            if first:
                first = False
                started.wait(60)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(PROMPTS))]
    for t in readers:
        t.start()
    started.wait(60)  # both streams are producing tokens
    workers = _status(client, capsys)
    busy = [w for n, w in sorted(workers.items()) if n.startswith("decode") and w["running"]]
    assert busy, workers  # (the streams run for MAX_TOKENS steps: they are still there)
    victim = busy[0]
    os.kill(victim["ranks"][1]["pid"], signal.SIGKILL)
    for t in readers:
        t.join(120)
    assert texts == expected
    proc.wait_for(rf"{victim['name']}: \w+ -> DEAD", 60)
    deadline = time.monotonic() + 60
    while True:  # (a finished request's blocks are freed by its worker's next engine pass)
        live = [w for w in _status(client, capsys).values() if w["state"] != "DEAD"]
        if all(w["running"] == 0 and w["waiting"] == 0 and w["kv_use"] == 0 for w in live):
            break
        assert time.monotonic() < deadline, live
        time.sleep(0.2)


def test_scale_adds_a_one_device_decode_worker_and_a_stream_moves_across_tp(
    server, tiny_dir, capsys
):
    """`tandem scale --engine tensor_parallel_size=1` adds a one-device decode worker beside
    the TP-2 one(s); a running stream moves from one TP size to the other and back with
    `tandem migrate` (gathered from a TP-2 worker's ranks, scattered to them), its text equal
    to transformers'; afterwards no live worker holds a block."""
    import json

    from hf_oracle import hf_greedy_ids

    from cluster.cli import main

    _, client = server
    path, _ = tiny_dir
    port = str(client.base_url.port)
    op = ["--serve-port", port, "--timeout", "120"]
    max_tokens = 480  # (the tiny model's 512 positions): outlasts two moves
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    expected = tok.decode(
        hf_greedy_ids(model, tok(PROMPTS[1])["input_ids"], max_tokens), skip_special_tokens=True
    )

    live = [w for w in _status(client, capsys).values() if w["state"] != "DEAD"]
    decode = [w["name"] for w in live if w["role"] == "decode"]
    bad = ["scale", *op, "--role", "decode", "--replicas", str(len(decode) + 1)]
    assert main([*bad, "--engine", "block_size=32"]) != 0  # not a worker's own setting
    assert "block_size" in capsys.readouterr().err
    add = ["scale", *op, "--role", "decode", "--replicas", str(len(decode) + 1), "--wait"]
    assert main([*add, "--engine", "tensor_parallel_size=1"]) == 0, capsys.readouterr()
    assert f"decode: {len(decode)} -> {len(decode) + 1}" in capsys.readouterr().out
    workers = _status(client, capsys)
    (new,) = [n for n, w in workers.items() if w["role"] == "decode" and n not in decode]
    assert [r["rank"] for r in workers[new]["ranks"]] == [0]
    assert all(len(workers[n]["ranks"]) == 2 for n in decode)

    text, started = [""], threading.Event()

    def read() -> None:
        stream = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPTS[1],
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            text[0] += chunk.choices[0].text
            started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    (home,) = [n for n, w in _status(client, capsys).items() if w["running"] and n != "prefill-0"]
    other = new if home != new else decode[0]
    moves = []
    for src, dst in ((home, other), (other, home)):
        rc = main(["migrate", *op, "--from", src, "--to", dst, "-o", "json"])
        moves.append((rc, json.loads(capsys.readouterr().out)))
    reader.join(120)
    assert [rc for rc, _ in moves] == [0, 0], moves
    assert text[0] == expected
    deadline = time.monotonic() + 60
    while True:
        live = [w for w in _status(client, capsys).values() if w["state"] != "DEAD"]
        if all(w["running"] == 0 and w["waiting"] == 0 and w["kv_use"] == 0 for w in live):
            break
        assert time.monotonic() < deadline, live
        time.sleep(0.2)
