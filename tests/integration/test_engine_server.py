"""`tidal serve` as a real process, driven by the one HTTP client, with the test process as weight sender.

Every request the client builds is validated against SGLang's own definitions (``api_types.py`` where a
generated type exists, else the request struct's fields in ``io_struct.py``, read with ``ast`` because
that module cannot be imported without SGLang's runtime dependencies), and every response of the engine
is parsed with SGLang's generated types.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tidal.model_config import ModelConfig
from tidal.procs import free_port
from tidal.rollout.embedded import native_step
from tidal.rollout.embedded.model import NamedTensorLoader, build_model
from tidal.rollout.embedded.testing import TINY_QWEN3, served_engine
from tidal.rollout.http_client import SGLangClient
from tidal.weights_sync import bucket
from tidal.weights_sync.transport import create_group

pytestmark = pytest.mark.slow

SGLANG = Path(importlib.util.find_spec("sglang").origin).parent
MODEL = TINY_QWEN3
SEED = 7
# long requests (~4090 tokens) stay running while a test acts on them, even on a loaded host: the native
# step decodes this model's token in tens of microseconds (~0.2 s for such a request, PyTorch's ops ~1 s)
MAX_SEQ = 4096


def _load_api_types():
    spec = importlib.util.spec_from_file_location("sglang_api_types", SGLANG / "api" / "v1" / "api_types.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


API = _load_api_types()


def _io_struct_fields() -> dict[str, tuple[set[str], set[str]]]:
    """class name -> (all fields, required fields) of sglang/srt/managers/io_struct.py's request structs."""
    tree = ast.parse((SGLANG / "srt" / "managers" / "io_struct.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            fields, required = {"rid", "http_worker_ipc"}, set()
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    fields.add(stmt.target.id)
                    if stmt.value is None:
                        required.add(stmt.target.id)
            out[node.name] = (fields, required)
    return out


IO_STRUCT = _io_struct_fields()
ROUTE_STRUCTS = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
}


class ValidatingClient(SGLangClient):
    """The production client, with every request body checked against SGLang's definitions."""

    validated: list[str] = []

    def build(self, route, body):
        if route == "/generate":
            unknown = set(body) - set(API.GenerateRequest.__struct_fields__)
            assert not unknown, f"/generate keys SGLang does not define: {unknown}"
            API.GenerateRequest.from_json_value(json.loads(json.dumps(body)))
        elif route == "/abort_request":
            assert set(body) <= set(API.AbortRequest.__struct_fields__)
            API.AbortRequest.from_json_value(body)
        elif route in ROUTE_STRUCTS:
            fields, required = IO_STRUCT[ROUTE_STRUCTS[route]]
            assert set(body) <= fields, f"{route}: keys {set(body) - fields} not in SGLang's request"
            assert required <= set(body), f"{route}: missing required {required - set(body)}"
        elif body is not None:
            raise AssertionError(f"no SGLang definition checked for {route}")
        ValidatingClient.validated.append(route)
        return body


def parse_generate(raw: dict) -> object:
    resp = API.GenerateResponse.from_json_value(raw)
    assert resp.meta_info is not None and resp.meta_info.finish_reason is not None
    assert not isinstance(resp.meta_info.finish_reason, dict), f"unknown finish reason {raw['meta_info']}"
    return resp


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with served_engine(
        MODEL,
        f"seed={SEED}",
        "rollout.engine.max_batch_size=8",
        f"rollout.engine.max_seq_len={MAX_SEQ}",
        "rollout.engine.weight_update_timeout_s=60",
        "rollout.engine.num_threads=1",
        log_path=tmp_path_factory.mktemp("engine") / "serve.log",
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def local():
    """The same random model in this process (same config and seed), and a loader for updates."""
    lm = build_model(ModelConfig(**MODEL), seed=SEED, device="cpu", dtype="float32")
    return lm, NamedTensorLoader(lm)


# long enough (prompt + LONG < MAX_SEQ) that a request is still running when the test acts on it
LONG = MAX_SEQ - 6


async def wait_running(client, n: int, timeout_s: float = 60) -> None:
    """Until ``n`` requests are decoding (admitted and prefilled, so each has its first tokens)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if (await client.server_info())["internal_states"][0]["running"] >= n:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"{n} requests never ran together")


def run(coro):
    return asyncio.run(coro)


def greedy_reference(lm, prompt, n):
    return lm.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()


def teacher_logprobs(lm, prompt, out):
    with torch.no_grad():
        logits = lm(torch.tensor([prompt + out])).logits[0]
    return (
        torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(out)[:, None]).squeeze(1)
    )


def test_generate_matches_local_model_and_parses_as_sglang(engine, local):
    lm, _ = local

    async def go():
        client = ValidatingClient(engine.url)
        try:
            prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4], [11, 12]]
            results = await asyncio.gather(
                *[client.generate(p, {"max_new_tokens": 12, "temperature": 0.0}) for p in prompts]
            )
            info = await client.model_info()
            API.GetModelInfoResponse.from_json_value(info)
            server_info = await client.server_info()
            API.GetServerInfoResponse.from_json_value(server_info)
            return prompts, results, info, server_info
        finally:
            await client.close()

    prompts, results, info, server_info = run(go())
    assert info["weight_version"] == "default" and info["model_type"] == "qwen3"
    # one intra-op thread (the fixture's num_threads=1): the served tokens come from the native step
    step = server_info["internal_states"][0]["cpu_step"]
    assert step.startswith("native" if native_step.load()[0] is not None else "torch"), step
    for prompt, res in zip(prompts, results, strict=True):
        parse_generate(res.raw)
        assert res.output_ids == greedy_reference(lm, prompt, 12)
        assert torch.allclose(
            torch.tensor(res.output_logprobs), teacher_logprobs(lm, prompt, res.output_ids), atol=1e-4
        )
        assert res.finish_reason == {"type": "length", "length": 12}
        assert res.token_versions == ["default"] * 12
    # a batch body returns a list, one response per prompt, each an SGLang GenerateResponse
    raw = httpx.post(
        f"{engine.url}/generate",
        json={"input_ids": prompts[:2], "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        timeout=60,
    ).json()
    assert [r["output_ids"] for r in raw] == [res.output_ids[:3] for res in results[:2]]
    for r in raw:
        parse_generate(r)


def test_n_samples_of_a_prompt_in_one_request_as_sglang_names_them(engine, local):
    lm, _ = local
    prompt = [4, 5, 6, 7]

    async def go():
        client = ValidatingClient(engine.url)  # the body with sampling_params.n validates as SGLang's
        try:
            greedy = await client.generate_n(prompt, {"max_new_tokens": 5, "temperature": 0.0}, 3, rid="grp")
            sampled = await client.generate_n(prompt, {"max_new_tokens": 5, "temperature": 1.0}, 4)
            return greedy, sampled
        finally:
            await client.close()

    greedy, sampled = run(go())
    assert [r.rid for r in greedy] == ["grp_0", "grp_1", "grp_2"]  # SGLang's names for parallel samples
    expected = greedy_reference(lm, prompt, 5)
    for res in greedy + sampled:
        parse_generate(res.raw)
        assert len(res.output_ids) == 5 and len(res.output_logprobs) == 5
        assert torch.allclose(
            torch.tensor(res.output_logprobs), teacher_logprobs(lm, prompt, res.output_ids), atol=1e-4
        )
    assert all(res.output_ids == expected for res in greedy)
    assert len({r.rid for r in sampled}) == 4


def test_bad_requests_get_400_with_a_message_and_the_server_keeps_serving(engine):
    url = engine.url
    cases = [
        (
            "/generate",
            {"input_ids": [1, 500], "sampling_params": {"max_new_tokens": 2}},
            "outside the vocabulary",
        ),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 2}}, "top_p"),
        ("/generate", {"input_ids": [1], "sampling_params": {"nonsense": 1}}, "nonsense"),
        ("/generate", {"input_ids": [1] * MAX_SEQ}, "context length"),
        ("/generate", {"text": "hello"}, "no tokenizer"),
        ("/generate", {"sampling_params": {}}, "text or input_ids"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        (
            "/update_weights_from_distributed",
            {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
            "init_weights_update_group",
        ),
        ("/destroy_weights_update_group", {"group_name": "nope"}, "nope"),
        ("/get_weights_by_name", {"name": "model.nothing"}, "unknown parameter name"),
    ]
    for route, body, needle in cases:
        resp = httpx.post(url + route, json=body, timeout=30)
        assert resp.status_code == 400, (route, body, resp.text)
        assert needle in resp.text, (route, resp.text)
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    resp = httpx.post(url + "/generate", content=b"{not json", timeout=30)
    assert resp.status_code == 400 and "not valid JSON" in resp.text
    ok = httpx.post(
        url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout=60
    )
    assert ok.status_code == 200
    parse_generate(ok.json())


def _sender_group(port, group_name, holder):
    holder["group"] = create_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name=group_name,
        timeout_s=60,
    )


def test_weight_updates_from_this_process_reach_the_model_mid_request(engine, local):
    lm, loader = local
    group_name = "tidal-test"
    port = free_port()
    hf = {name: loader.read(name) for name, _ in lm.named_parameters()}  # checkpoint names and shapes
    new = {name: torch.randn_like(p) * 0.2 for name, p in hf.items() if name.startswith("model.layers.1.")}
    everything = [(name, torch.randn_like(p) * 0.2) for name, p in hf.items()]

    async def broadcast_with(coro, tensors):
        def send():
            for t in tensors:
                holder["group"].broadcast(t, src=0)

        await asyncio.gather(coro, asyncio.to_thread(send))

    holder: dict = {}

    async def go():
        client = ValidatingClient(engine.url)
        try:
            assert await client.needs_weight_update_session()
            sender = threading.Thread(target=_sender_group, args=(port, group_name, holder))
            sender.start()
            await client.init_weights_update_group(
                master_address="127.0.0.1",
                master_port=port,
                rank_offset=1,
                world_size=2,
                group_name=group_name,
                backend="gloo",
            )
            await asyncio.to_thread(sender.join, 60)

            # a long request in flight across an in-place update: its later tokens carry the new version
            long = asyncio.create_task(
                client.generate([5, 6, 7], {"max_new_tokens": LONG, "temperature": 0.0})
            )
            await wait_running(client, 1)
            await client.pause("in_place")
            names = list(new)
            async with client.weight_update_session():
                await broadcast_with(
                    client.update_weights_from_distributed(
                        names=names,
                        dtypes=["float32"] * len(names),
                        shapes=[list(new[n].shape) for n in names],
                        group_name=group_name,
                        weight_version="1",
                    ),
                    [new[n] for n in names],
                )
            await client.resume()
            long_result = await long
            first_name = names[0]
            served = await client.get_weights_by_name(first_name, truncate_size=4)
            after_first = await client.generate([1, 2, 3], {"max_new_tokens": 10, "temperature": 0.0})

            # the whole model as one flattened bucket, not paused: SGLang's drain semantics
            buf, spec = bucket.pack(everything)
            await broadcast_with(
                client.update_weights_from_distributed(
                    names=spec.names,
                    dtypes=spec.dtypes,
                    shapes=spec.shapes,
                    group_name=group_name,
                    weight_version="2",
                    load_format="flattened_bucket",
                ),
                [buf],
            )
            after_second = await client.generate([1, 2, 3], {"max_new_tokens": 10, "temperature": 0.0})

            # a wrong name is received (the sender's broadcast completes), then refused, naming it
            bad = torch.zeros(3)
            with pytest.raises(Exception, match="model.layers.0.bogus"):
                await broadcast_with(
                    client.update_weights_from_distributed(
                        names=["model.layers.0.bogus"],
                        dtypes=["float32"],
                        shapes=[[3]],
                        group_name=group_name,
                    ),
                    [bad],
                )
            # tidal's checksum extension: a corrupted bucket is refused and nothing is loaded
            small = [(names[0], torch.ones_like(new[names[0]]))]
            small_buf, small_spec = bucket.pack(small)
            body = {
                "names": small_spec.names,
                "dtypes": small_spec.dtypes,
                "shapes": small_spec.shapes,
                "group_name": group_name,
                "load_format": "flattened_bucket",
                "checksum": bucket.checksum(small_buf) + 1,
            }
            async with httpx.AsyncClient(base_url=engine.url, timeout=60) as raw_http:
                post = raw_http.post("/update_weights_from_distributed", json=body)
                refused, _ = await asyncio.gather(
                    post, asyncio.to_thread(holder["group"].broadcast, small_buf, 0)
                )
            info = await client.model_info()

            # the sender rebuilds its group under the same name (nodes joined or left): the engine follows
            holder["group"].destroy()
            port2 = free_port()
            sender = threading.Thread(target=_sender_group, args=(port2, group_name, holder))
            sender.start()
            await client.init_weights_update_group(
                master_address="127.0.0.1",
                master_port=port2,
                rank_offset=1,
                world_size=2,
                group_name=group_name,
                backend="gloo",
            )
            await asyncio.to_thread(sender.join, 60)
            await broadcast_with(
                client.update_weights_from_distributed(
                    names=small_spec.names,
                    dtypes=small_spec.dtypes,
                    shapes=small_spec.shapes,
                    group_name=group_name,
                    load_format="flattened_bucket",
                    weight_version="3",
                ),
                [small_buf],
            )
            rebuilt = await client.get_weights_by_name(names[0], truncate_size=2)
            await client.destroy_weights_update_group(group_name)
            assert refused.status_code == 400 and "checksum" in refused.json()["message"], refused.text
            assert torch.equal(torch.tensor(rebuilt), torch.ones_like(new[names[0]])[:2])
            return names, long_result, served, after_first, after_second, info
        finally:
            holder["group"].destroy() if "group" in holder else None
            await client.close()

    names, long_result, served, after_first, after_second, info = run(go())
    parse_generate(long_result.raw)
    spans = long_result.raw["meta_info"]["weight_versions"]
    assert (
        [s["version"] for s in spans] == ["default", "1"]
        and spans[0]["start"] == 0
        and spans[-1]["end"] == LONG
    )
    assert long_result.token_versions == ["default"] * spans[0]["end"] + ["1"] * (LONG - spans[0]["end"])
    assert long_result.weight_version == "1"

    loader.load(list(new.items()))
    assert torch.allclose(torch.tensor(served), new[names[0]][:4], atol=1e-6)
    assert after_first.output_ids == greedy_reference(lm, [1, 2, 3], 10)
    assert after_first.token_versions == ["1"] * 10
    loader.load(everything)
    assert after_second.output_ids == greedy_reference(lm, [1, 2, 3], 10)
    assert torch.allclose(
        torch.tensor(after_second.output_logprobs),
        teacher_logprobs(lm, [1, 2, 3], after_second.output_ids),
        atol=1e-4,
    )
    assert after_second.weight_version == "2" and info["weight_version"] == "2"
    # a request that began under one version and ended under the next: both kept as versions of its tokens
    assert {
        "/update_weights_from_distributed",
        "/begin_weight_update",
        "/end_weight_update",
        "/init_weights_update_group",
    } <= set(ValidatingClient.validated)


def test_abort_request_and_pause_abort_return_partial_outputs(engine):
    async def go():
        client = ValidatingClient(engine.url)
        try:
            a = asyncio.create_task(
                client.generate([3, 4], {"max_new_tokens": LONG, "temperature": 0.0}, rid="to-abort")
            )
            b = asyncio.create_task(client.generate([3, 5], {"max_new_tokens": LONG, "temperature": 0.0}))
            await wait_running(client, 2)
            await client.abort("to-abort")
            ra = await a
            await client.pause("abort")
            rb = await b
            late = asyncio.create_task(client.generate([3, 6], {"max_new_tokens": 2, "temperature": 0.0}))
            await asyncio.sleep(0.2)
            assert not late.done(), "a request ran while generation was paused"
            await client.resume()
            late_result = await late
            await client.update_weight_version("5", abort_all_requests=True)
            assert (await client.model_info())["weight_version"] == "5"
            return ra, rb, late_result, await client.flush_cache()
        finally:
            await client.close()

    ra, rb, late, flushed = run(go())
    for r in (ra, rb):
        parse_generate(r.raw)
        assert r.aborted and len(r.output_ids) < LONG and len(r.output_logprobs) == len(r.output_ids)
    assert ra.rid == "to-abort"
    assert late.finish_reason == {"type": "length", "length": 2}
    assert flushed


def test_a_client_that_disconnects_has_its_request_aborted(engine):
    # paused, the request can only wait in the queue: it must leave the queue when its client goes away
    assert (
        httpx.post(f"{engine.url}/pause_generation", json={"mode": "in_place"}, timeout=10).status_code == 200
    )
    try:
        body = {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 8}}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{engine.url}/generate", json=body, timeout=1.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = httpx.get(f"{engine.url}/server_info", timeout=10).json()["internal_states"][0]
            if state["waiting"] == 0:
                break
            time.sleep(0.1)
        assert state["waiting"] == 0 and state["running"] == 0 and state["paused"] == "in_place", state
    finally:
        httpx.post(f"{engine.url}/continue_generation", json={}, timeout=10)
