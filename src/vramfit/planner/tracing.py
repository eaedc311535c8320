"""Tracing one training step on fake tensors: the allocation log the estimate is computed from.

1. Build the exact model the trainer builds (`models.create.create_model(..., load_weights=False)`: no
   download, freezing / BN policy / grad checkpointing / channels_last applied) and the exact
   optimizer (`optim.create_optimizer`), then move every parameter and buffer to *fake* tensors
   (`FakeTensorMode`): shapes, dtypes and strides without memory.
2. Run one micro-batch of the trainer's own step (`train.step.StepMaths`, the definition `TrainStep`
   runs: forward, summed loss, backward, gradient norm / clip, optimizer update with its state
   already allocated), with what Accelerate adds (autocast, fp32 logits, loss scaling), under
   a small `TorchDispatchMode` that sees every tensor the step creates and a weakref finaliser on
   every storage, so it knows the live bytes after each op.

Why a hand-written dispatch mode and not `torch.distributed._tools.mem_tracker.MemTracker`: both
see the same allocations (on the same fake ResNet50 fp32 batch-32 step MemTracker's peak is
3,089,966,776 B, ours 3,090,013,696 B with 512-byte rounding), but MemTracker updates every
module's statistics on every op. Measured on the 2-core dev box (torch 2.14, same process, same
fake model, warm): MemTracker 2.0 s per step, this recorder 0.27 s. The recorder also keeps the
ordered allocation log that the linear model of `estimate` needs; the per-module attribution
MemTracker adds is not something `plan` prints.

Why fake *CPU* tensors with CUDA's autocast rules: fake CUDA tensors would pick CUDA's autocast op
lists, but the autograd engine refuses to run backward on them without a driver
(`hasPrimaryContext`), and no other fake device has both a device guard and autocast kernels. CPU
autocast uses a different op list (for example `layer_norm`, `softmax`, `exp`, `sum` stay in bf16
on CPU but run in fp32 on CUDA, which changes what ConvNeXt and ViTs save). So while tracing we
register, for the `AutocastCPU` key only and only for the duration of the trace, kernels that apply
CUDA's policy (the op lists of ATen/autocast_mode.h, copied below) and fall through for ops only
CPU autocasts. Everything else (conv, batch norm, pooling, activations) runs through the same
autograd formulas as on a GPU, so the saved tensors are the ones a GPU saves.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import Config

# ---------------------------------------------------------------------------------------------
# CUDA autocast rules on CPU fake tensors (see module docstring).
# Copied from ATen/autocast_mode.h (torch 2.14): AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, AT_FORALL_PROMOTE.
# tests/test_planner.py checks that this covers every op with an AutocastCUDA kernel in the
# installed torch, so a torch upgrade that changes the lists fails a test instead of drifting.

_LOWER = """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv
linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
_scaled_dot_product_flash_attention scaled_dot_product_attention""".split()
_FP32 = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm
group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss
cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d
upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa""".split()
_FP32_SET_OPT_DTYPE = """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum
linalg_vector_norm linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList""".split()
_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()
# CUDA autocast raises on these ("unsafe to autocast"); so do we.
_BANNED = ["binary_cross_entropy"]
# CUDA-only kernels a CPU tensor never reaches.
CUDA_ONLY_OPS = {"_cudnn_rnn", "cudnn_convolution", "cudnn_convolution_transpose", "linalg_matrix_sqrth"}

CUDA_AUTOCAST_POLICY: dict[str, str] = {
    **{n: "lower" for n in _LOWER}, **{n: "fp32" for n in _FP32},
    **{n: "fp32_set_opt_dtype" for n in _FP32_SET_OPT_DTYPE},
    **{n: "fp32_append_dtype" for n in _FP32_APPEND_DTYPE}, **{n: "promote" for n in _PROMOTE},
    **{n: "banned" for n in _BANNED},
}

_AUTOCAST_LOCK = threading.RLock()
_TRACE_LOCK = threading.RLock()
_cpu_autocast_ops: list[str] | None = None


def _op(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _cpu_autocast_op_names() -> list[str]:
    """Ops with a CPU autocast kernel in this torch (read once, before we add our own)."""
    global _cpu_autocast_ops
    if _cpu_autocast_ops is None:
        _cpu_autocast_ops = [n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
                             if n.startswith("aten::")
                             and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")]
    return _cpu_autocast_ops


def _eligible(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64
            and t.device.type == "cpu")


class _CastCache:
    """autocast's weight cache: a fp32 leaf that requires grad is cast once per autocast region."""

    def __init__(self):
        self.enabled = False
        self.casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype, cacheable: bool) -> torch.Tensor:
        if t.dtype is dtype:
            return t
        if (cacheable and self.enabled and t.dtype is torch.float32 and t.requires_grad and t.is_leaf
                and not t._is_view() and torch.is_autocast_cache_enabled()):
            hit = self.casts.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            out = t.to(dtype)
            self.casts[id(t)] = (t, out)
            return out
        return t.to(dtype)


_CACHE = _CastCache()
_NO_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _map_tensors(fn, args, kwargs):
    def one(a):
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(one(x) for x in a)
        return fn(a) if _eligible(a) else a
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _make_kernel(name: str, policy: str):
    op = _op(name)

    def call(o, args, kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST_CPU):
            return o(*args, **kwargs)

    if policy in ("lower", "fp32"):
        def kernel(*args, **kwargs):
            dt = torch.get_autocast_dtype("cpu") if policy == "lower" else torch.float32
            args, kwargs = _map_tensors(lambda t: _CACHE.cast(t, dt, policy == "lower"), args, kwargs)
            return call(op, args, kwargs)
    elif policy == "fp32_set_opt_dtype":
        pos = [i for i, a in enumerate(op._schema.arguments) if a.name == "dtype" and not a.kwarg_only]

        def kernel(*args, **kwargs):
            if args and _eligible(args[0]):
                if pos and len(args) > pos[0]:
                    if args[pos[0]] is None:
                        args = args[:pos[0]] + (torch.float32,) + args[pos[0] + 1:]
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return call(op, args, kwargs)
    elif policy == "fp32_append_dtype":
        op_dtype = _op(_FP32_APPEND_DTYPE[name])

        def kernel(*args, **kwargs):
            if args and _eligible(args[0]):
                return call(op_dtype, args, {**kwargs, "dtype": torch.float32})
            return call(op, args, kwargs)
    elif policy == "banned":
        def kernel(*args, **kwargs):
            raise RuntimeError(f"{name} is unsafe to autocast (CUDA autocast refuses it too): use "
                               "binary_cross_entropy_with_logits")
    else:  # promote: everything to the widest floating type among the eligible arguments
        def kernel(*args, **kwargs):
            dts = []
            _map_tensors(lambda t: dts.append(t.dtype) or t, args, kwargs)
            lp = torch.get_autocast_dtype("cpu")
            dt = lp if dts and all(d is lp for d in dts) else torch.float32
            args, kwargs = _map_tensors(lambda t: _CACHE.cast(t, dt, dt is lp), args, kwargs)
            return call(op, args, kwargs)
    return kernel


@contextlib.contextmanager
def cuda_autocast_rules_on_cpu():
    """While active, CPU autocast applies CUDA's op lists (for tracing only; process-wide)."""
    with _AUTOCAST_LOCK:
        cpu_ops = _cpu_autocast_op_names()
        lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - scoped override, destroyed below
        try:
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
                for name, policy in CUDA_AUTOCAST_POLICY.items():
                    try:
                        _op(name)
                    except (AttributeError, RuntimeError):
                        continue  # not in this torch version
                    lib.impl(name, _make_kernel(name, policy), "AutocastCPU")
                for name in cpu_ops:
                    if name not in CUDA_AUTOCAST_POLICY:
                        lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            yield
        finally:
            lib._destroy()


# ---------------------------------------------------------------------------------------------
# The recorder: live storages during one step

# Categories of an allocation (indices into the breakdown)
PARAM, BUFFER, OPT, HOST, INPUT, ACT, WCAST, BWD, STEP, GRAD = range(10)
CATEGORY_NAMES = ["param", "buffer", "optimizer", "host", "input", "activation", "weight_cast",
              "backward", "step", "grad"]


class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Allocation log of every tensor storage created while active (plus registered ones).

    A storage is allocated when an op first returns a tensor on it, and freed when its Python
    storage object dies (refcount -> 0; gc is disabled during the trace so this is deterministic).
    """

    def __init__(self, param_ids: set[int]):
        super().__init__()
        self.sizes: list[int] = []
        self.cats: list[int] = []
        self.events: list[int] = []  # i >= 0: allocation i; ~i: allocation i freed
        self._live: dict[int, int] = {}  # id(storage) -> allocation index
        self._refs: dict[int, weakref.ref] = {}
        self.param_ids = param_ids
        self.phase = INPUT
        self.end_forward = -1  # index into events where backward starts
        self.end_backward = -1  # index into events where backward ended
        self.closed = False

    def register(self, t: torch.Tensor, cat: int) -> int:
        st = t.untyped_storage()
        key = id(st)
        i = self._live.get(key)
        if i is not None:
            return i
        i = len(self.sizes)
        self.sizes.append(st.nbytes())
        self.cats.append(cat)
        self.events.append(i)
        self._live[key] = i
        self._refs[key] = weakref.ref(st, lambda _r, key=key: self._free(key))
        return i

    def index_of(self, t: torch.Tensor) -> int | None:
        return self._live.get(id(t.untyped_storage()))

    def _free(self, key: int) -> None:
        i = self._live.pop(key, None)
        self._refs.pop(key, None)
        if i is not None and not self.closed:
            self.events.append(~i)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.resize_.default or func is torch.ops.aten.set_.source_Storage:
            st = args[0].untyped_storage()
            i = self._live.get(id(st))
            if i is not None and self.sizes[i] != st.nbytes():  # resized in place: free + alloc
                cat = self.cats[i]
                self._free(id(st))
                self.register(args[0], cat)
            return out
        cat = self.phase
        if (func is torch.ops.aten._to_copy.default and args and id(args[0]) in self.param_ids):
            cat = WCAST  # autocast's low-precision copy of a weight
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.register(t, cat)
            elif isinstance(t, (list, tuple)):
                for u in t:
                    if isinstance(u, torch.Tensor):
                        self.register(u, cat)
        return out


@dataclass
class AllocationLog:
    sizes: np.ndarray  # bytes per allocation (before rounding)
    cats: np.ndarray
    events: np.ndarray
    end_forward: int
    end_backward: int
    grads: np.ndarray  # allocation indices that are parameter .grad storages


# ---------------------------------------------------------------------------------------------
# Building the fake model and tracing one step


def build_fake(cfg: Config, num_classes: int, fake_mode, on_meta: bool, model_fn=None):
    from ..models.create import create_model
    from ..train.optim import create_optimizer

    ctx = torch.device("meta") if on_meta else contextlib.nullcontext()
    with ctx:
        if model_fn is not None:
            model = model_fn()
        else:
            model = create_model(cfg.model, num_classes, load_weights=False, image_size=cfg.data.image_size)
    with fake_mode:
        model = model.to_empty(device="cpu")  # fake tensors; keeps dtype, strides (channels_last), requires_grad
        model.train()
        optimizer = create_optimizer(model, cfg.optim)
        for group in optimizer.param_groups:
            # On CUDA, torch.optim defaults to the multi-tensor (foreach) kernels; fake tensors would
            # make it fall back to the per-tensor loop, whose temporaries are smaller.
            if "foreach" in group and group.get("fused") is not True:
                group["foreach"] = True
        trainable = [p for p in model.parameters() if p.requires_grad]
        # Steady state: the optimizer state exists before the measured step.
        for p in trainable:
            p.grad = torch.zeros_like(p)
        if trainable:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, trainable


class Tracer:
    """A fake model + optimizer, traced at any micro-batch on demand."""

    def __init__(self, cfg: Config, num_classes: int, precision: str, model_fn=None):
        self.cfg, self.num_classes, self.precision, self.model_fn = cfg, num_classes, precision, model_fn
        self.build(on_meta=True)

    def build(self, on_meta: bool) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.model, self.optimizer, self.trainable = build_fake(
            self.cfg, self.num_classes, self.fake_mode, on_meta, self.model_fn)
        self.on_meta = on_meta

    def forward_flops(self, batch: int = 2) -> float:
        """FLOPs of one image's forward (torch's FlopCounterMode on the fake model: 2 per
        multiply-add, so ResNet50 at 224 px counts 8.2 G where timm lists 4.1 GMACs)."""
        from torch.utils.flop_counter import FlopCounterMode

        size = self.cfg.data.image_size
        counter = FlopCounterMode(display=False)
        with _TRACE_LOCK, torch.no_grad(), self.fake_mode, counter:
            self.model(torch.empty((batch, 3, size, size), dtype=torch.float32))
        return counter.get_total_flops() / batch

    def trace(self, batch: int) -> AllocationLog:
        with _TRACE_LOCK:  # gc and the autocast kernels are process-wide: one trace at a time
            return self._trace(batch)

    def _trace(self, batch: int) -> AllocationLog:
        model, optimizer, trainable = self.model, self.optimizer, self.trainable
        lp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        fmt = torch.channels_last if self.cfg.model.channels_last else torch.contiguous_format
        rec = Recorder({id(p) for p in model.parameters()})
        for p in model.parameters():
            rec.register(p, PARAM)
        for b in model.buffers():
            rec.register(b, BUFFER)
        for state in optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    # torch.optim keeps `step` on the host unless capturable/fused.
                    rec.register(v, HOST if k == "step" and v.dim() == 0 else OPT)
        gc_was_enabled = gc.isenabled()
        gc.disable()  # frees must happen at the same op in every trace
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autocast("cpu", enabled=False))  # whatever the caller had on
                if lp is not None:
                    stack.enter_context(cuda_autocast_rules_on_cpu())
                stack.enter_context(self.fake_mode)
                stack.enter_context(rec)
                self._step(rec, model, optimizer, trainable, batch, self.cfg.data.image_size, lp, fmt)
        finally:
            rec.closed = True
            if gc_was_enabled:
                gc.enable()
        return AllocationLog(sizes=np.array(rec.sizes, dtype=np.int64), cats=np.array(rec.cats, dtype=np.int64),
                    events=np.array(rec.events, dtype=np.int64), end_forward=rec.end_forward,
                    end_backward=rec.end_backward, grads=np.array(self._grad_indices, dtype=np.int64))

    def _step(self, rec, model, optimizer, trainable, batch, size, lp, fmt):
        """One micro-batch of the trainer's own step (train.step.StepMaths: forward, loss, backward),
        then its gradient norm / clip and optimizer update, with what Accelerate adds around them
        (autocast and fp32 logits, GradScaler's scale and unscale)."""
        from ..train.step import step_maths

        maths = step_maths(self.cfg.train)
        # The normalized per-process batch (loop: normalize(batch.images)) lives for the whole
        # step; micro-batches are views of it. Traced at `batch`, re-sized to the per-process batch
        # when evaluated (category INPUT).
        rec.phase = INPUT
        images = torch.empty((batch, 3, size, size), dtype=torch.float32, memory_format=fmt)
        labels = torch.zeros((batch,), dtype=torch.long)
        rec.phase = ACT

        def forward(x):
            if lp is None:
                return model(x)
            _CACHE.enabled, _CACHE.casts = True, {}
            with torch.autocast("cpu", dtype=lp):
                logits = model(x)
            _CACHE.enabled, _CACHE.casts = False, {}
            return logits.float()  # accelerate's convert_outputs_to_fp32

        def backward(scaled):
            rec.end_forward = len(rec.events)
            rec.phase = BWD
            if self.precision == "fp16":
                scaled = scaled * 65536.0  # GradScaler.scale
            if scaled.requires_grad:  # (everything frozen: nothing to do)
                scaled.backward()

        loss_sum, correct = maths.micro_batch(forward, backward, images, labels, batch)
        del loss_sum, correct
        rec.end_backward = len(rec.events)
        self._grad_indices = [i for i in (rec.index_of(p.grad) for p in trainable if p.grad is not None)
                              if i is not None]
        rec.phase = STEP
        if self.precision == "fp16":  # GradScaler.unscale_: in place
            torch._foreach_mul_([p.grad for p in trainable if p.grad is not None], 1.0 / 65536.0)
        if trainable:
            maths.grad_norm(torch.nn.utils.clip_grad_norm_, trainable)
            maths.update(optimizer)
        optimizer.zero_grad(set_to_none=True)
        del images, labels
