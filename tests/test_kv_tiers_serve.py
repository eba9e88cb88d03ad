"""The KV tiers through `tandem serve` over a socket (SmolLM2 fp32 on CPU, real workers, real
Redis): a prefix pushed out of a small device pool comes back from the host tier; the second
turn of a disaggregated conversation loads the first turn's answer, which the decode worker wrote
to the disk tier the prefill worker reads; after a stop and a new `tandem serve` on the same
folder, prefixes come back from disk. Greedy tokens equal transformers' throughout."""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_process import CliProcess, free_port

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("ray")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
PROMPT_LEN = 200  # 12 full blocks; one token is always computed, so 192 can be cached
# 40 blocks of 16 tokens per worker: a third 200-token prompt pushes the first one out
ENGINE = ["num_kv_blocks=40", "block_size=16", "max_num_seqs=4"]


@pytest.fixture(scope="module")
def env():
    return {**os.environ, "TANDEM_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(300, 40000) for _ in range(PROMPT_LEN)] for _ in range(4)]


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    """transformers' greedy ids of a prompt, and their text."""
    import torch
    import transformers
    from hf_oracle import hf_greedy_ids

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)

    def greedy(prompt: list[int], n: int = 8) -> tuple[list[int], str]:
        # one torch thread: this runs beside a server's start, and a second thread on 2 busy
        # cores spins (a 9 s oracle took 70 s so)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ids = hf_greedy_ids(model.eval(), prompt, n)
        finally:
            torch.set_num_threads(threads)
        return ids, tok.decode(ids, skip_special_tokens=True)

    return greedy


def serve(smollm2_dir, env, topology: list[str], engine: list[str]) -> tuple[CliProcess, str]:
    port = free_port()
    args = ["serve", "--model", str(smollm2_dir), "--device", "cpu", "--port", str(port)]
    args += [*topology, "--shutdown-timeout", "3"]
    for setting in [*ENGINE, *engine]:
        args += ["--engine", setting]
    proc = CliProcess(args, env)
    proc.wait_for(r"^serving http://", 300)
    return proc, f"http://127.0.0.1:{port}/v1"


def complete(client, prompt: list[int], max_tokens: int = 8) -> tuple[str, int]:
    """(greedy text, cached prompt tokens) of one completion."""
    return complete_routed(client, prompt, max_tokens)[:2]


def complete_routed(client, prompt: list[int], max_tokens: int = 8) -> tuple[str, int, str]:
    """(greedy text, cached prompt tokens, its prefill worker: "none" when one worker
    prefilled and decoded it) of one completion."""
    raw = client.completions.with_raw_response.create(
        model=client.model_name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    out = raw.parse()
    details = out.usage.prompt_tokens_details
    cached = (details.cached_tokens if details else 0) or 0
    return out.choices[0].text, cached, raw.headers["x-tandem-prefill"]


def make_client(url: str):
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    client.model_name = client.models.list().data[0].id
    return client


def wait_for_files(folder: Path, hashes: list[bytes], timeout_s: float = 60.0) -> None:
    """Until a block file of each hash is in the disk tier's folder (written by an I/O thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [h for h in hashes if not list(folder.glob(f"*/{h.hex()[:2]}/{h.hex()}.kv"))]
        if not missing:
            return
        assert time.monotonic() < deadline, f"{len(missing)} block files never written"
        time.sleep(0.05)


def test_host_tier_and_a_conversation_across_prefill_and_decode(
    smollm2_dir, env, disk_dir, prompts, hf
):
    from engine.block_manager import prefix_block_hashes

    def oracle() -> dict[str, list[int] | str]:
        """transformers' answers, turn by turn (each turn is built from the answer before)."""
        expect_first = hf(prompts[0])[1]
        answer, answer_text = hf(prompts[3], 40)
        turn1 = prompts[3] + answer
        turn2 = turn1 + prompts[1][:30]  # 46 tokens the decode worker lacks: a prefill worker's
        want2, text2 = hf(turn2)
        turn3 = turn2 + want2 + prompts[1][30:35]
        want3, text3 = hf(turn3)
        turn4 = turn3 + want3 + prompts[1][35:40]
        text4 = hf(turn4)[1]
        return dict(
            expect_first=expect_first,
            answer_text=answer_text,
            turns=(turn1, turn2, turn3, turn4),
            texts=(text2, text3, text4),
        )

    tiers = ["kv_offload_cpu_gb=0.1", f"kv_offload_disk_dir={disk_dir}"]
    # a next turn the decode worker lacks at most 16 tokens of is prefilled there
    pd = ["--prefill", "1", "--decode", "1", "--local-prefill-tokens", "16"]
    # transformers' answers while the first server starts (all are known before a request)
    with ThreadPoolExecutor(1) as pool:
        answers = pool.submit(oracle)
        proc, url = serve(smollm2_dir, env, pd, tiers)
        try:
            o = answers.result()
        except BaseException:
            proc.stop()
            raise
    expect_first, answer_text = o["expect_first"], o["answer_text"]
    (turn1, turn2, turn3, turn4), (text2, text3, text4) = o["turns"], o["texts"]
    try:
        client = make_client(url)
        first, cached = complete(client, prompts[0])
        assert (first, cached) == (expect_first, 0)
        for p in prompts[1:3]:  # push prompt 0 out of the prefill worker's device pool
            complete(client, p)
        again, cached = complete(client, prompts[0])
        assert (again, cached) == (first, 192), "from the prefill worker's host tier"

        # A conversation: turn 2 is turn 1's prompt, its answer, and a new message. The decode
        # worker computed the answer's KV; it wrote those blocks to the shared disk tier.
        assert complete(client, prompts[3], max_tokens=40)[0] == answer_text
        hashes = prefix_block_hashes(turn1[:-1], BLOCK)  # the last token has no KV yet
        assert len(hashes) == 14
        wait_for_files(disk_dir, hashes[12:])
        text, cached, prefill = complete_routed(client, turn2)
        assert cached == 14 * BLOCK, "prompt blocks from the prefill worker, answer from disk"
        assert prefill != "none"
        assert text == text2

        # Turn 3 adds 5 tokens to turn 2 and its answer: the decode worker holds all the rest
        # (its own 17 blocks), so it prefills and decodes turn 3 itself.
        text, cached, prefill = complete_routed(client, turn3)
        assert (prefill, cached) == ("none", 17 * BLOCK)
        assert text == text3
        # and turn 4 after that local turn: its answer is on the decode worker as well
        text, cached, prefill = complete_routed(client, turn4)
        assert (prefill, cached) == ("none", 18 * BLOCK)
        assert text == text4
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.tail()

    # A new `tandem serve` on the same folder, no host tier: prefixes come back from disk.
    proc, url = serve(smollm2_dir, env, ["--colocated", "1"], [f"kv_offload_disk_dir={disk_dir}"])
    try:
        client = make_client(url)
        again, cached = complete(client, prompts[0])
        assert (again, cached) == (first, 192), "from disk after a restart"
        # turn 2's own blocks were written when it ran: 16 of its 269 tokens' full blocks
        assert complete(client, turn2) == (text2, 16 * BLOCK)
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.tail()
