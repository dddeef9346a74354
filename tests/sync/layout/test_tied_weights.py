"""Aliases (tied weights): a tensor published under several names is sent once and applied
under every name the target has.

The end-to-end tests publish ``model.state_dict()`` of tiny Hugging Face models built from
configs (nothing is downloaded), tied and untied, into a differently initialised model of the
same config on a rollout, and compare logits bit for bit.
"""

from __future__ import annotations

import logging

import torch
from sync_procs import remote_reads_allowed, spawn
from torch import nn

import slipstream as ss
from slipstream.sync.layout.aliases import unique_tensors
from slipstream.sync.layout.plan import BucketPlan, layout_json, plan_from_json

BUCKET = 64 * 1024
SEPARATE = 4096
REMOTE_READS = remote_reads_allowed()
LOCAL = "cma" if REMOTE_READS else "shm"


# --------------------------------------------------------------------- no processes
def test_tensors_sharing_storage_offset_shape_and_stride_are_sent_once_under_every_name():
    base = torch.randn(4, 6)
    empty = torch.empty(0)
    items = [
        ("emb", base),
        ("other", torch.randn(3)),
        ("head", base.detach()),  # the same bytes seen the same way: an alias
        ("flat", base.view(-1)),  # another shape
        ("rows", base[1:]),  # another offset
        ("cols", base.t()),  # another stride
        ("as_int", base.view(torch.int32)),  # another dtype
        ("head2", nn.Parameter(base)),  # a parameter over the same storage
        ("e1", empty),
        ("e2", torch.empty(0)),  # no bytes of its own: never taken for an alias
        ("e3", empty),  # ... unless it is the very same tensor
    ]
    specs, tensors = unique_tensors(items)
    assert [s.names for s in specs] == [
        ("emb", "head", "head2"),
        ("other",),
        ("flat",),
        ("rows",),
        ("cols",),
        ("as_int",),
        ("e1", "e3"),
        ("e2",),
    ]
    assert tensors[0] is base and len(tensors) == len(specs)
    # the aliases are part of the layout, so of the plan id, and survive the store
    plan = BucketPlan.build(specs, BUCKET, [0])
    again = plan_from_json(layout_json(plan.specs, plan.bucket_bytes, plan.trainer_ranks))
    assert again == plan and again.specs[0].aliases == ("head", "head2")
    untied = [s if not s.aliases else type(s)(s.name, s.shape, s.dtype) for s in specs]
    assert BucketPlan.build(untied, BUCKET, [0]).plan_id != plan.plan_id


# --------------------------------------------------------------------- Hugging Face models
# (family, tied on the trainer, tied on the rollout, transport, mode, atomic on rollout 1)
CASES = [
    ("gpt2", True, True, "relay", "direct", False),
    ("llama", True, True, "shm", "cached", True),
    ("llama", False, False, "broadcast", "direct", False),
    ("qwen2", True, True, LOCAL, "direct", False),
    ("qwen2", False, False, "relay", "cached", False),
    # a tie on the trainer, none on the rollout: the one tensor sent lands under both names
    ("llama", True, False, "relay", "direct", False),
    ("llama", True, False, LOCAL, "cached", True),
]
TOKENS = torch.arange(2 * 12).reshape(2, 12) * 5 % 128


def make_model(family: str, tied: bool, seed: int) -> nn.Module:
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        }[family]
        config = config_cls(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=tied,
        )  # fmt: skip
        model = model_cls(config)
    return model.eval()


def is_tied(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def train_step(model: nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(TOKENS).logits.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _hf_run(rank, port):
    """Per case, the trainer publishes two versions of ``state_dict()`` (a training step
    between them) and puts its logits on the store; rollout 1 receives into its model,
    rollout 2 through a ``load_weights`` callable, and each compares its logits with the
    trainer's (results stay small: they cross a pipe)."""
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=30)
    out = {}
    for case in CASES:
        family, tied_trainer, tied_rollout, transport, mode, atomic = case
        key = "/".join(map(str, case))
        if rank == 0:
            model = make_model(family, tied_trainer, seed=0)
            assert is_tied(model) == tied_trainer
            sd = model.state_dict()
            sent = []
            with ss.WeightPublisher(
                group, [0], [1, 2], bucket_bytes=BUCKET, mode=mode, transport=transport,
                separate_min_bytes=SEPARATE,
            ) as pub:  # fmt: skip
                for version in (1, 2):
                    before = pub.bytes_sent
                    h = pub.publish(model.state_dict(), version=version)
                    h.delivered.result(timeout=20)
                    sent.append(pub.bytes_sent - before)
                    raw = logits(model).contiguous().view(-1).view(torch.uint8)
                    group.store.set(f"test/{key}/{version}", raw.numpy().tobytes())
                    train_step(model)
            unique = {t.data_ptr(): t.numel() * t.element_size() for t in sd.values()}
            out[key] = {
                "names": sorted(sd),
                "sent": sent[0],
                "all_bytes": sum(t.numel() * t.element_size() for t in sd.values()),
                "unique_bytes": sum(unique.values()),
            }
            continue
        model = make_model(family, tied_rollout, seed=10 + rank)
        exact, names = [], []
        with ss.WeightSubscriber(group, [0], [1, 2]) as sub:
            for version in (1, 2):
                if rank == 1:
                    assert sub.receive(model, atomic=atomic) == version
                else:  # a load_weights callable gets every name, aliases included
                    got: list[tuple[str, torch.Tensor]] = []
                    sub.receive(lambda batch, got=got: got.extend((n, t.clone()) for n, t in batch))
                    names.append(sorted(n for n, _ in got))
                    own = model.state_dict(keep_vars=True)
                    with torch.no_grad():
                        for n, t in got:
                            own[n].copy_(t)
                mine = logits(model)
                group.wait_keys({0: f"test/{key}/{version}"}, "the trainer's logits", 20)
                raw = bytearray(group.store.get(f"test/{key}/{version}"))
                theirs = torch.frombuffer(raw, dtype=torch.uint8).view(mine.dtype).view(mine.shape)
                exact.append(torch.equal(mine, theirs))
        out[key] = {"exact": exact, "names": names, "tied": is_tied(model)}
    group.close()
    return out


def test_hugging_face_state_dicts_tied_and_untied_arrive_exact_and_ties_stay_tied():
    import transformers  # noqa: F401  (in the test extra: never skipped)

    out = spawn(_hf_run, 3, timeout=120)
    for case in CASES:
        tied_trainer, tied_rollout = case[1:3]
        key = "/".join(map(str, case))
        trainer, module, loader = out[0][key], out[1][key], out[2][key]
        assert "lm_head.weight" in trainer["names"], key
        # the rollouts' logits equal the trainer's, bit for bit, after either version
        assert module["exact"] == [True, True] and loader["exact"] == [True, True], key
        assert module["tied"] == tied_rollout and loader["tied"] == tied_rollout, key
        # every name of the state dict reached the callable, each version (all changed)
        assert loader["names"] == [trainer["names"]] * 2, key
        # a tie crosses once: the first publish sends every byte but the alias's
        sent, unique, every = trainer["sent"], trainer["unique_bytes"], trainer["all_bytes"]
        assert unique <= sent < unique + 64 * len(trainer["names"]), key
        assert (unique < every) == tied_trainer, key


# --------------------------------------------------------------------- two trainers, DTensor
def _dtensor_tied_run(rank, port, mesh_port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    group = ss.sync.init_group("127.0.0.1", port, 4, rank, timeout=30)
    g = torch.Generator().manual_seed(3)
    emb, w = torch.randn(256, 32, generator=g), torch.randn(64, 32, generator=g)
    if rank in (0, 1):
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{mesh_port}", rank=rank, world_size=2
        )
        mesh = init_device_mesh("cpu", (2,))
        d_emb = nn.Parameter(distribute_tensor(emb, mesh, [Shard(0)]))
        named = {"emb.weight": d_emb, "w": distribute_tensor(w, mesh, [Shard(0)])}
        named["head.weight"] = d_emb  # tied: the same DTensor under a second name
        with ss.WeightPublisher(
            group, [0, 1], [2, 3], bucket_bytes=BUCKET, transport="relay"
        ) as pub:
            pub.publish(named, version=1).delivered.result(timeout=20)
            sent = pub.bytes_sent
        torch.distributed.destroy_process_group()
        group.close()
        return sent
    target = nn.Module()
    target.emb = nn.Embedding(256, 32)
    target.head = nn.Linear(32, 256, bias=False)
    target.head.weight = target.emb.weight
    target.register_buffer("w", torch.zeros(64, 32))
    with ss.WeightSubscriber(group, [0, 1], [2, 3]) as sub:
        assert sub.receive(target) == 1
    group.close()
    assert target.head.weight is target.emb.weight
    return torch.equal(target.emb.weight, emb) and torch.equal(target.w, w)


def test_two_trainers_agree_on_aliases_of_dtensor_sources():
    from dist_utils import free_port

    out = spawn(_dtensor_tied_run, 4, free_port(), timeout=90)
    assert out[2] is True and out[3] is True
    assert out[0] + out[1] < 2 * 256 * 32 * 4  # the tied embedding crossed once
