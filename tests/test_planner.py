"""The memory planner: exact on hand-countable models, sane on real ones, fast, offline.

Hand counts below round every tensor up to the CUDA caching allocator's 512-byte blocks (`r`).
"""

import io
import json
import time

import pytest
import torch
from torch import nn

from vramfit import planner as P
from vramfit.config import PACKAGE_RECIPES, Config

MiB, GiB = 2**20, 2**30


def r(n: int) -> int:
    return -(-n // 512) * 512


def cfg_of(**sections) -> Config:
    return Config.model_validate(sections)


# ---------------------------------------------------------------------------------------------
# CUDA autocast rules on CPU


def test_autocast_table_covers_every_cuda_autocast_op():
    cuda_ops = {n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
                if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}
    missing = cuda_ops - set(P.CUDA_AUTOCAST_POLICY) - P.CUDA_ONLY_OPS
    assert not missing, f"torch's CUDA autocast lists changed; add to planner.CUDA_AUTOCAST_POLICY: {missing}"


def test_cuda_autocast_rules_apply_only_inside_the_context():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with P.cuda_autocast_rules_on_cpu(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(x, w).dtype is torch.bfloat16  # lower precision on both
        assert nn.functional.layer_norm(x.bfloat16(), (8,)).dtype is torch.float32  # fp32 on CUDA only
        assert torch.softmax(x.bfloat16(), -1).dtype is torch.float32  # fp32_set_opt_dtype
        assert torch.cat([x.bfloat16(), x]).dtype is torch.float32  # plain type promotion, no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU's own rules are back
        assert nn.functional.layer_norm(x.bfloat16(), (8,)).dtype is torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Exactness against hand counts (the constants are left out: compare allocated bytes)

NO_EXTRAS = dict(precision="no", label_smoothing=0.0, clip_grad_norm=None)


def test_mlp_backward_peak_matches_hand_count():
    B, D, H, C = 4096, 3 * 8 * 8, 1024, 10
    cfg = cfg_of(data={"image_size": 8}, train={"global_batch": B, **NO_EXTRAS})
    est = P.estimate_model(lambda: nn.Sequential(nn.Flatten(), nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C)), cfg, B)
    params = r(H * D * 4) + r(H * 4) + r(C * H * 4) + r(C * 4)
    assert est.params_bytes == params
    assert est.optimizer_bytes == 2 * params  # AdamW exp_avg + exp_avg_sq (step counters live on the host)
    # Peak: inside ReLU's backward. Alive: weights, AdamW state, the input batch (x, labels), the
    # ReLU output r1 (saved), its incoming grad and the grad it produces (each B x H), the fp32
    # logits the engine keeps for accuracy, and the grads of the second layer already computed.
    x, labels, act, logits = r(B * D * 4), r(B * 8), r(B * H * 4), r(B * C * 4)
    hand = 3 * params + x + labels + 3 * act + logits + r(C * H * 4) + r(C * 4)
    assert est.peak_phase == "backward"
    assert abs(est.allocated_bytes - hand) <= 0.01 * hand
    assert est.grads_bytes == r(C * H * 4) + r(C * 4)


def test_the_plan_follows_the_step_the_trainer_runs(monkeypatch):
    """The planner traces train.step.StepMaths, the step definition TrainStep runs: a loss that keeps
    a wider fp32 log-softmax for its backward moves the plan by at least what it keeps, with no
    change to the planner."""
    import torch.nn.functional as F

    from vramfit.train import step

    B, C, WIDEN = 8, 1000, 64
    cfg = cfg_of(model={"name": "test_resnet"}, data={"image_size": 32}, train={"global_batch": B, **NO_EXTRAS})

    def keeps_more(logits, y, label_smoothing):
        return F.cross_entropy(logits.float().repeat(1, WIDEN), y, reduction="sum")

    P.clear_profiles()
    before = P.estimate(cfg, C, B)
    monkeypatch.setattr(step, "cross_entropy_sum", keeps_more)
    assert step.step_maths(cfg.train).loss_fn is keeps_more  # what TrainStep is built with (train.build)
    P.clear_profiles()
    after = P.estimate(cfg, C, B)
    P.clear_profiles()
    kept = r(B * C * WIDEN * 4)  # the log-softmax cross_entropy saves for backward
    assert after.allocated_bytes - before.allocated_bytes >= kept, (before.allocated_bytes, after.allocated_bytes)


def test_mlp_optimizer_peak_matches_hand_count():
    B, D, H, C = 64, 3 * 32 * 32, 512, 10
    cfg = cfg_of(data={"image_size": 32}, train={"global_batch": B, **NO_EXTRAS})
    est = P.estimate_model(lambda: nn.Sequential(nn.Flatten(), nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C)), cfg, B)
    params = r(H * D * 4) + r(H * 4) + r(C * H * 4) + r(C * 4)
    # Small batch: the peak is torch's multi-tensor AdamW, which holds sqrt(exp_avg_sq) of one param
    # group (timm: weights with decay, biases without) next to weights, grads and both moments.
    hand = params + params + 2 * params + (r(H * D * 4) + r(C * H * 4)) + r(B * D * 4) + r(B * 8)
    assert est.peak_phase == "optimizer"
    assert est.grads_bytes == params and est.optimizer_bytes == 2 * params
    assert abs(est.allocated_bytes - hand) <= 0.01 * hand


def _conv_stack():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_conv_stack_saved_activations_match_hand_count(precision):
    B, S = 32, 32
    cfg = cfg_of(data={"image_size": S}, train={"global_batch": B, **{**NO_EXTRAS, "precision": precision}})
    prof = P.Profile(cfg, 10, precision, _conv_stack)
    at = prof.live_at_end_of_forward(B)
    e = 2 if precision == "bf16" else 4  # bytes per activation element
    c1, c2 = r(B * 16 * S * S * e), r(B * 32 * (S // 2) ** 2 * e)
    stats = 2 * r(16 * 4) + 2 * r(32 * 4)  # BatchNorm's fp32 batch mean / inverse std, saved
    scalars = 2 * 512  # loss, nll_loss's total_weight
    # Saved: conv out (by BN) and BN out (ReLU'd in place; by ReLU and the next conv) of both
    # convs, the pooled features (by the linear), fp32 logits (the engine keeps them) and log_softmax.
    hand = 2 * c1 + 2 * c2 + stats + r(B * 32 * e) + 2 * r(B * 10 * 4) + scalars
    if precision == "bf16":
        hand += r(B * 3 * S * S * 2)  # autocast's bf16 copy of the input, saved by conv1
        # bf16 weight copies saved by the convs and the linear (the bias copy is not saved)
        assert at[P.WCAST] == r(16 * 3 * 9 * 2) + r(32 * 16 * 9 * 2) + r(10 * 32 * 2)
    assert at[P.INPUT] == r(B * 3 * S * S * 4) + r(B * 8)  # the fp32 input batch + labels
    assert abs(at[P.ACT] - hand) <= 0.01 * hand, (at[P.ACT], hand)
    assert at[P.PARAM] == r(16 * 3 * 9 * 4) + r(32 * 16 * 9 * 4) + r(10 * 32 * 4) + r(10 * 4) + 4 * r(16 * 4) \
        - 2 * r(16 * 4) + 2 * r(32 * 4)  # conv weights, linear, BN affine (16 and 32 channels)


def test_two_traces_give_every_batch_exactly():
    cfg = cfg_of(model={"name": "test_resnet"}, data={"image_size": 64}, train={"precision": "bf16"})
    prof = P.get_profile(cfg, 10, "bf16")
    assert prof.linear
    for b in (3, 16):
        log = prof.tracer.trace(b)
        assert (log.events == prof.log.events).all()
        assert (log.sizes == prof.const + prof.slope * b).all()


# ---------------------------------------------------------------------------------------------
# Real models: direction of every knob


@pytest.mark.parametrize("name,size", [("test_resnet", 64), ("test_resnet", 224), ("resnet18", 64), ("resnet18", 224)])
def test_peak_monotonic_and_knobs_lower_it(name, size):
    base = dict(model={"name": name}, data={"image_size": size}, train={"global_batch": 64, "precision": "no"})
    fp32 = P.estimate_table(cfg_of(**base), 100, [1, 2, 4, 8, 16, 32, 64])
    peaks = [e.peak_bytes for e in fp32]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    bf16 = P.estimate(cfg_of(**base), 100, 32, precision="bf16")
    ckpt = P.estimate(cfg_of(**{**base, "model": {"name": name, "grad_checkpointing": True}}), 100, 32)
    assert bf16.peak_bytes < fp32[5].peak_bytes
    assert bf16.activations_bytes < fp32[5].activations_bytes
    assert ckpt.peak_bytes < fp32[5].peak_bytes


def test_breakdown_matches_the_real_model_on_cpu():
    """The trace against the real model, by other means: parameters, buffers and AdamW state counted
    from the real module, and the activations from a real CPU forward of the step the trainer runs
    (train.step.StepMaths, called here, not written again) whose saved tensors are collected with
    autograd's saved-tensor hooks (fp32 CPU kernels save what the fake ones do)."""
    from vramfit.models.create import create_model
    from vramfit.train.step import step_maths

    B, S = 8, 64
    cfg = cfg_of(model={"name": "test_resnet"}, data={"image_size": S}, train={"global_batch": 64, "precision": "no"})
    model = create_model(cfg.model, 100, load_weights=False).train()
    state = [*model.parameters(), *model.buffers()]
    est = P.estimate(cfg, 100, B, per_process_batch=B)
    assert est.params_bytes == sum(r(t.numel() * t.element_size()) for t in state)
    assert est.optimizer_bytes == 2 * sum(r(p.numel() * 4) for p in model.parameters())

    held = {t.untyped_storage().data_ptr() for t in state}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in held:
            saved[st.data_ptr()] = st.nbytes()
        return t

    kept = {}

    def forward(images):
        kept["logits"] = model(images)
        return kept["logits"]

    def backward(scaled):  # what the step hands to backward: the loss over the step's samples
        kept["scaled"] = scaled

    x, y = torch.randn(B, 3, S, S), torch.randint(0, 100, (B,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = step_maths(cfg.train).micro_batch(forward, backward, x, y, B)
    saved.pop(x.untyped_storage().data_ptr())  # the input batch and labels are the INPUT line
    saved.pop(y.untyped_storage().data_ptr())
    # Alive at the end of the forward: what autograd saved, + the logits, the loss and the loss over
    # the step's samples (each storage once: autograd may save one of them too).
    for t in (kept["logits"], loss, kept["scaled"]):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    real = sum(r(n) for n in saved.values())
    assert P.get_profile(cfg, 100, "no").live_at_end_of_forward(B)[P.ACT] == real


def test_accumulation_frozen_layers_and_ddp():
    cfg = cfg_of(model={"name": "resnet18"}, data={"image_size": 64}, train={"global_batch": 64, "precision": "no"})
    alone = P.estimate(cfg, 100, 16, per_process_batch=16)
    accum = P.estimate(cfg, 100, 16, per_process_batch=64)
    assert accum.accumulating and not alone.accumulating
    assert accum.allocated_bytes > alone.allocated_bytes  # earlier grads + a bigger input batch
    frozen_cfg = P.config_with(cfg, {"model.freeze": ["conv1", "bn1", "layer1", "layer2"]})
    frozen = P.estimate(frozen_cfg, 100, 16, per_process_batch=16)
    assert frozen.optimizer_bytes < alone.optimizer_bytes
    saved = P.get_profile(cfg, 100, "no").live_at_end_of_forward(16)[P.ACT]
    saved_frozen = P.get_profile(frozen_cfg, 100, "no").live_at_end_of_forward(16)[P.ACT]
    assert saved_frozen < 0.5 * saved  # frozen leading stages save nothing for backward


@pytest.mark.parametrize("freeze", [[], ["conv1", "bn1", "layer1"]], ids=["all", "frozen"])
def test_two_processes_add_exactly_the_gradient_reducers_buckets(freeze, monkeypatch):
    """With 2 processes the gradients line holds the gradients + what collectives.GradReducer
    allocates for the same trainable parameters (built here as on 2 processes, and measured)."""
    from vramfit.models.create import create_model
    from vramfit.runtime import collectives

    cfg = cfg_of(model={"name": "test_resnet", "freeze": freeze}, data={"image_size": 32},
                 train={"global_batch": 16, "precision": "no"})
    model = create_model(cfg.model, 10, load_weights=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    monkeypatch.setattr(collectives, "world_size", lambda: 2)
    reducer = collectives.GradReducer(trainable, bucket_bytes=4096)  # several buckets
    monkeypatch.setattr(collectives, "BUCKET_BYTES", 4096)
    held = reducer.buffer_bytes
    assert held == collectives.reducer_buffer_bytes(
        [(p.numel() * p.element_size(), p.dtype) for p in trainable]) > 0
    for micro in (4, 8):
        one = P.estimate(cfg, 10, micro, per_process_batch=8)
        two = P.estimate(cfg, 10, micro, num_processes=2, per_process_batch=8)
        assert two.grads_bytes == one.grads_bytes + held
        assert two.allocated_bytes == one.allocated_bytes + held


# ---------------------------------------------------------------------------------------------
# Picking and advice


def test_pick_micro_batch_is_the_largest_that_fits_divisor_or_not():
    """Against every micro-batch 1..100 estimated one by one: the pick is the largest that fits
    (named by its largest chunk, as batching splits the share), found with a few estimates."""
    from vramfit.batching import largest_chunk

    per = 100
    cfg = cfg_of(model={"name": "resnet18"}, data={"image_size": 128}, train={"global_batch": per, "precision": "bf16"})
    peaks = {e.micro_batch: e.peak_bytes for e in P.estimate_table(cfg, 100, list(range(1, per + 1)))}
    distinct = sorted(set(peaks.values()))
    picks = []
    for lo, hi in zip(distinct[::7], distinct[1::7]):
        budget = (lo + hi) // 2
        pick, tried = P.pick_micro_batch(cfg, 100, per, budget)
        fitting = [m for m in range(1, per + 1) if peaks[m] <= budget]
        assert pick == largest_chunk(per, max(fitting))
        assert peaks[pick] <= budget and len(tried) <= 10
        picks.append(pick)
    assert any(per % p for p in picks)  # the pick is not limited to divisors any more
    assert P.pick_micro_batch(cfg, 100, per, peaks[1] - 1)[0] is None


def _check_options(cfg, options, budget):
    assert [o["cost"] for o in options] == sorted(o["cost"] for o in options)
    for o in options:
        est = P.estimate(P.config_with(cfg, o["set"]), 100, o["micro_batch"], per_process_batch=64)
        assert est.peak_bytes <= budget
        assert o["peak_bytes"] == est.peak_bytes and o["set"]["train.micro_batch"] == o["micro_batch"]


def test_advise_options_each_fit():
    cfg = cfg_of(model={"name": "resnet18"}, data={"image_size": 224},
                 train={"global_batch": 64, "micro_batch": 64, "precision": "no"})
    # The configured micro-batch 64 is too big, 8 fits: the free fix (same maths) comes first.
    budget = P.estimate(cfg, 100, 8, per_process_batch=64).peak_bytes + MiB
    options = P.advise(cfg, 100, 64, budget)
    assert options[0]["cost"] == 0 and options[0]["micro_batch"] == 8
    changes = " | ".join(o["change"] for o in options)
    assert "bf16" in changes and "gradient checkpointing" in changes and "freeze" in changes
    _check_options(cfg, options, budget)
    bf16 = next(o for o in options if o["change"] == "bf16 autocast")
    assert bf16["micro_batch"] >= 8

    # Not even micro-batch 1 fits: weights + grads + AdamW state dominate, so only training fewer
    # weights helps (resnet18 has no lighter sibling in the table).
    budget = P.estimate(cfg, 100, 1, per_process_batch=64).peak_bytes - 1
    options = P.advise(cfg, 100, 64, budget)
    assert options and all(o["cost"] > 0 for o in options)
    _check_options(cfg, options, budget)
    assert P.advise(cfg, 100, 64, 10 * GiB) == []


def test_lighter_backbones():
    assert P.lighter_backbones("resnet50.a1_in1k") == ["resnet34", "resnet18"]
    assert P.lighter_backbones("efficientnet_b3") == ["efficientnet_b2", "efficientnet_b0"]
    assert P.lighter_backbones("convnext_base")[0] == "convnext_small"
    assert P.lighter_backbones("resnet18") == []


# ---------------------------------------------------------------------------------------------
# `vramfit plan`


def test_plan_offline_with_pretrained_true(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub
    import timm.models._builder as builder
    import timm.models._hub as hub

    def no_network(*a, **k):
        raise AssertionError("the planner must not load or download weights")

    for mod, name in [(huggingface_hub, "hf_hub_download"), (hub, "hf_hub_download"),
                      (torch.hub, "load_state_dict_from_url"), (builder, "load_pretrained"),
                      (builder, "load_custom_pretrained")]:
        monkeypatch.setattr(mod, name, no_network)
    P.clear_profiles()
    cfg = cfg_of(model={"name": "resnet18", "pretrained": True}, data={"image_size": 64},
                 train={"global_batch": 32, "micro_batch": "auto"}, hardware={"memory_gib": 12})
    buf = io.StringIO()
    res = P.run_plan(cfg, 10, as_json=True, out=buf)
    printed = json.loads(buf.getvalue())
    assert printed["pick"] == 32 and printed["micro_batch"] == 32 and printed["fits"] is True
    assert res["estimate"]["peak_bytes"] == printed["predicted_peak_bytes"]
    json.dumps({k: v for k, v in res.items()})  # plan.json is plain JSON
    sizes = [row["micro_batch"] for row in res["table"]]
    assert sizes == [1, 2, 4, 8, 16, 32]


def test_plan_text_without_budget_and_a_micro_batch_that_does_not_divide():
    cfg = cfg_of(model={"name": "test_resnet"}, data={"image_size": 64}, train={"global_batch": 24})
    buf = io.StringIO()
    res = P.run_plan(cfg, 10, out=buf)
    text = buf.getvalue()
    assert res["fits"] is None and res["micro_batch"] == 24 and "no memory budget" in text
    for label in ("parameters", "gradients", "optimizer state", "activations", "temporaries", "allocator",
                  "CUDA context", "peak"):
        assert f"  {label}" in text
    assert {row["micro_batch"] for row in res["table"]} == {1, 2, 4, 8, 16, 24}
    # 24 samples at micro-batch 5: five near-equal forwards (5 + 5 + 5 + 5 + 4), no error.
    res = P.run_plan(cfg, 10, micro_batch=5, out=io.StringIO())
    assert (res["micro_batch"], res["grad_accum_steps"], res["estimate"]["largest_forward"]) == (5, 5, 5)
    assert "5 x 5" in res["text"]


def test_plan_gives_progressive_resizing_a_micro_batch_per_size():
    """`vramfit plan` with data.progressive_resize: every size the run may train at, with the
    micro-batch the run would take there (larger at the small sizes, where more images fit the card;
    never below the full size's) and the peak that bounds it, within the budget."""
    from vramfit.data.progressive import possible_sizes

    cfg = cfg_of(model={"name": "resnet18"}, data={"image_size": 64, "progressive_resize": True},
                 train={"global_batch": 1024, "micro_batch": "auto"}, hardware={"memory_gib": 3})
    res = P.run_plan(cfg, 10, out=io.StringIO())
    rows = res["sizes"]
    assert [r["image_size"] for r in rows] == possible_sizes(cfg) and rows[0]["image_size"] == 32
    micro = [r["micro_batch"] for r in rows]
    assert micro == sorted(micro, reverse=True) and micro[-1] == res["micro_batch"] == 512 < micro[0]
    assert all(r["predicted_peak_bytes"] <= res["budget_bytes"] for r in rows)
    assert all(r["predicted_at_size"] >= r["image_size"] for r in rows)  # a carried peak is a larger size's
    text = res["text"].splitlines()
    at = text.index("progressive resizing: micro-batch per image size (the global batch is the same at every size)")
    assert [line.split()[0] for line in text[at + 1:]] == ["32-52", "56-64"]
    assert "sizes" not in P.run_plan(cfg.model_copy(update={"data": cfg.data.model_copy(
        update={"progressive_resize": None})}), 10, out=io.StringIO())


def _resnet50_plan():
    P.clear_profiles()
    cfg = cfg_of(model={"name": "resnet50"}, data={"image_size": 224},
                 train={"global_batch": 256, "micro_batch": 256, "precision": "no"}, hardware={"memory_gib": 12})
    t0 = time.perf_counter()
    res = P.run_plan(cfg, 1000, out=io.StringIO())
    return cfg, res, time.perf_counter() - t0


@pytest.mark.slow
def test_resnet50_plan_time():
    """ResNet50 @ 224 on 2 CPU cores: cold plan with its table and advice well inside 30 s."""
    _, _, seconds = _resnet50_plan()
    assert seconds < 30, f"ResNet50 plan took {seconds:.1f} s"


def test_resnet50_plan_sanity_anchor():
    """Sanity anchor, fp32 AdamW batch 32: the literature's "~10-11 GB of activations + state" is not
    what PyTorch stores. Counted by hand from the layer shapes, ResNet50 saves 21.5 M values per
    224 px image (every conv output for its BatchNorm, every ReLU'd BatchNorm output that a conv or
    ReLU reads, the block outputs, max-pool output + int64 indices, the input): 85.9 MB/image, so
    2.56 GiB at batch 32, + 0.29 GiB of weights and AdamW state. The trace says the same (2.56 GiB
    activations, 2.9 GiB allocated, 4.79 GiB on nvidia-smi with the constants); ~10-11 GB is
    what batch ~120 would need.
    """
    cfg, res, _ = _resnet50_plan()
    # 3 forwards of 86 + 85 + 85 fit where 2 of 128 do not (the largest divisor of 256 was 64).
    assert res["fits"] is False and res["advice"] and res["pick"] == 86 and res["advice"][0]["micro_batch"] == 86

    e32 = P.estimate(cfg, 1000, 32, per_process_batch=32)
    per_image = 4 * 21_475_328
    assert abs(e32.activations_bytes - 32 * per_image) < 0.02 * 32 * per_image
    state = e32.params_bytes + e32.optimizer_bytes
    assert 0.25 * GiB < state < 0.32 * GiB
    assert 2.7 * GiB < e32.allocated_bytes < 3.1 * GiB
    bf16 = P.estimate(cfg, 1000, 32, precision="bf16", per_process_batch=32)
    assert bf16.activations_bytes < 0.6 * e32.activations_bytes


GPU_RECIPES = sorted(p for p in PACKAGE_RECIPES.glob("*.yaml")
                     if "memory_gib" in p.read_text())


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_every_gpu_recipe_is_predicted_to_fit_its_card(recipe, monkeypatch):
    """Each recipe that names a card fits it at its micro-batch (configured or picked), with the
    safety margin."""
    import io

    from vramfit.config import build_config
    from vramfit.planner import run_plan

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = build_config(str(recipe))
    res = run_plan(cfg, 1000, num_processes=cfg.hardware.gpus, out=io.StringIO())
    assert res["fits"] is True, f"{recipe.stem}: {res['predicted_peak_bytes'] / 2**30:.2f} GiB"
    assert res["predicted_peak_bytes"] <= res["budget_bytes"]
    if cfg.train.micro_batch == "auto":  # the planner's pick for the card
        assert res["micro_batch"] == res["pick"] and res["micro_batch_source"] == "auto"
    else:
        assert res["micro_batch"] == min(cfg.train.micro_batch, res["per_process_batch"])


def _published_bench():
    from helpers import bench_module

    return bench_module("published")


@pytest.mark.slow
def test_planner_against_every_published_fit_and_oom():
    """bench/published_memory.csv (every public fit / OOM pair; ~4 min of traces): at margin 0 no
    batch that ran is predicted over its card and >= 85 % of the OOM batches are; with the default
    margin the pick is below every OOM batch. ResNet50 224 px bf16 on 12 GB: the pick is >= 150."""
    info = _published_bench().report()[1]
    assert info["ran_predicted_over"] == 0, info
    assert info["oom_share"] >= 0.85, info
    assert info["oom_under_default_pick"] == 0, info
    cfg = cfg_of(model={"name": "resnet50"}, data={"image_size": 224},
                 train={"global_batch": 256, "micro_batch": "auto", "precision": "bf16"}, hardware={"memory_gib": 12})
    assert P.pick_micro_batch(cfg, 1000, 150, P.budget_bytes_for(cfg))[0] == 150


def test_published_fit_keeps_every_run_and_catches_what_it_can():
    """The fit of bench/published.py on rows with known allocated peaks (no tracing): the constants
    leave every batch that ran within its card and predict the OOM batches over theirs, on two card
    sizes; a batch that ran out of memory below one that ran (another library version) cannot be
    separated by any constants, and the margin is what keeps the default pick below it."""
    B = _published_bench()
    GiB = 2**30

    def row(gb, batch, outcome):
        return B.Row("test", "card", gb, "2.4", "bf16", "nchw", "sgd", "resnet50", 224, batch, outcome, None, "")

    rows = [row(12, 100, "ran"), row(12, 112, "oom"), row(24, 220, "ran"), row(24, 240, "oom")]
    per_image = int(0.1 * GiB)
    allocs = [r.batch * per_image for r in rows]
    c = B.fit(rows, allocs).constants
    for r, a in zip(rows, allocs):
        assert (c.peak(a) <= r.total) is (r.outcome == "ran"), (r, c)
    assert c.fixed > 0 and B.margin_for(rows, allocs, c) == B.MARGIN_FLOOR
    rows.append(row(12, 85, "oom"))
    allocs.append(85 * per_image)
    c = B.fit(rows, allocs).constants
    info = B.summary(rows, allocs, c, B.margin_for(rows, allocs, c))
    assert info["ran_predicted_over"] == 0 and info["oom_predicted_over"] == 2
    assert info["oom_under_default_pick"] == 0 and info["margin"] > B.MARGIN_FLOOR
    assert "OOM under the default pick" not in B.table(rows, allocs, c, info["margin"])


def test_plan_compares_backbones_by_memory(monkeypatch, capsys):
    """`vramfit plan --model A,B,C`: one row per backbone, in order; the costlier backbone fits fewer
    images; --json gives the same rows; a bad list exits 2 with a hint."""
    from vramfit.cli import run as main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["plan", "--model", "resnet34,test_resnet,resnet18", "--image-size", "64", "--global-batch", "32",
            "--memory-gib", "4", "--num-classes", "10"]
    assert main(args) == 0
    text = capsys.readouterr().out
    body = [line.split()[0] for line in text.splitlines()[3:6]]
    assert body == ["resnet34", "test_resnet", "resnet18"], text
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {r["model"]: r for r in plan["rows"]}
    assert list(rows) == ["resnet34", "test_resnet", "resnet18"]
    big, tiny, mid = rows["resnet34"], rows["test_resnet"], rows["resnet18"]
    assert big["num_params"] > mid["num_params"] > tiny["num_params"]
    assert big["gflops_per_image"] > mid["gflops_per_image"] > tiny["gflops_per_image"] > 0
    assert big["activation_bytes_per_image"] > mid["activation_bytes_per_image"] > 0
    assert 0 < big["largest_micro_batch"] < mid["largest_micro_batch"] < tiny["largest_micro_batch"]
    for r in rows.values():  # the largest fits the budget, one more does not
        assert r["largest_peak_bytes"] <= plan["budget_bytes"]
        cfg = cfg_of(model={"name": r["model"]}, data={"image_size": 64}, hardware={"memory_gib": 4})
        assert P.estimate(cfg, 10, r["largest_micro_batch"] + 1,
                          per_process_batch=r["largest_micro_batch"] + 1).peak_bytes > plan["budget_bytes"]
        assert f"{r['largest_micro_batch']:>7}" in text
    with pytest.raises(SystemExit) as exit_info:
        __import__("vramfit.cli").cli.main(["plan", "--model", "resnet18,,resnet34"])
    assert exit_info.value.code == 2 and "distinct model names" in capsys.readouterr().err


def test_plan_compares_backbones_only_for_a_named_card(monkeypatch, capsys):
    """`vramfit plan --model A,B` with no recipe for a card and no --memory-gib cannot say what fits:
    exit 2 at once, with a HINT naming --recipe and --memory-gib for the same models."""
    from vramfit.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "resnet50,efficientnet_b0"])
    err = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2 and "no card is named" in err and "Traceback" not in err
    assert "HINT:" in err and "vramfit plan --recipe rtx3060 --model resnet50,efficientnet_b0" in err
    assert "--memory-gib N --model resnet50,efficientnet_b0" in err


def test_a_cards_own_measurements_join_the_published_rows(tmp_path):
    """`memory_check.py --published --fit --with memory_check.json`: a card's measured steps become
    rows that ran (with their measured peak, on the whole card) and its pick-check probes rows that
    ran or ran out of memory under the capped card."""
    B = _published_bench()
    GiB = 2**30
    data = {"summary": {"device": "NVIDIA H200", "torch": "2.14.1+cu130", "device_total_bytes": 140 * GiB,
                        "cap_bytes": 12 * GiB},
            "rows": [{"model": "resnet50", "precision": "bf16", "grad_checkpointing": False, "micro_batch": 64,
                      "measured_peak": 5 * GiB},
                     {"model": "resnet50", "precision": "bf16", "grad_checkpointing": True, "micro_batch": 64,
                      "measured_peak": 3 * GiB}],
            "picks": [{"model": "resnet50", "precision": "no", "outcomes": {"96": True, "110": False}}]}
    path = tmp_path / "memory_check.json"
    path.write_text(json.dumps(data))
    rows = B.measured_rows(path)
    assert [(r.batch, r.outcome, r.precision, r.total) for r in rows] == [
        (64, "ran", "bf16", 140 * GiB), (96, "ran", "fp32", 12 * GiB), (110, "oom", "fp32", 12 * GiB)]
    assert rows[0].measured_peak_gib == 5 and rows[0].torch == "2.14"
    assert rows[1].config().train.precision in ("no", "fp32")  # fp32 by either name
