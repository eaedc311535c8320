"""Memory planner: the device memory of one steady-state training step, predicted without a GPU.

How (docs/memory.md has the long form):

1. Build the exact model the trainer builds (`models.create_model(..., load_weights=False)`: no
   download, freezing / BN policy / grad checkpointing / channels_last applied) and the exact
   optimizer (`optim.create_optimizer`), then move every parameter and buffer to *fake* tensors
   (`FakeTensorMode`): shapes, dtypes and strides without memory.
2. Run one training step the way `engine.train_step` runs it (autocast forward, fp32 logits, summed
   cross-entropy, backward, clip, optimizer step with its state already allocated, zero_grad) under
   a small `TorchDispatchMode` that sees every tensor the step creates and a weakref finaliser on
   every storage, so it knows the live bytes after each op -- rounded up to the CUDA caching
   allocator's 512-byte blocks.
3. Do it at two micro-batch sizes. Every allocation of a CNN step is `a + b * batch` bytes and the
   op sequence does not depend on the batch, so two traces give every allocation's size at *any*
   batch exactly (checked: the sequences must match and the slopes must be whole numbers; a model
   that breaks this falls back to one trace per size). A table of micro-batches then costs
   milliseconds, not traces.
4. Peak live bytes + a named allocator-overhead fraction + a named CUDA-context constant = the
   predicted peak as nvidia-smi would show it.

Why a hand-written dispatch mode and not `torch.distributed._tools.mem_tracker.MemTracker`: both
see the same allocations (on the same fake ResNet50 fp32 batch-32 step MemTracker's peak is
3,089,966,776 B, ours 3,090,013,696 B with 512-byte rounding), but MemTracker updates every
module's statistics on every op. Measured on the 2-core dev box (torch 2.14, same process, same
fake model, warm): MemTracker 2.0 s per step, this recorder 0.27 s. The recorder also keeps the
ordered allocation log that step 3 needs; the per-module attribution MemTracker adds is not
something `plan` prints.

Why fake *CPU* tensors with CUDA's autocast rules: fake CUDA tensors would pick CUDA's autocast op
lists, but the autograd engine refuses to run backward on them without a driver
(`hasPrimaryContext`), and no other fake device has both a device guard and autocast kernels. CPU
autocast uses a different op list (for example `layer_norm`, `softmax`, `exp`, `sum` stay in bf16
on CPU but run in fp32 on CUDA, which changes what ConvNeXt and ViTs save). So while tracing we
register, for the `AutocastCPU` key only and only for the duration of the trace, kernels that apply
CUDA's policy (the op lists of ATen/autocast_mode.h, copied below) and fall through for ops only
CPU autocasts. Everything else (conv, batch norm, pooling, activations) runs through the same
autograd formulas as on a GPU, so the saved tensors are the ones a GPU saves.

Not seen by the trace (and therefore in the named constants): the CUDA context, cuBLAS/cuDNN
workspaces, kernel-internal scratch memory, and allocator fragmentation.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .config import Config, _divisors
from .errors import VramfitError

GiB = 2**30
MiB = 2**20

# ---------------------------------------------------------------------------------------------
# Named constants. The trace is exact for what PyTorch allocates; these cover what it cannot see.
# All three are first guesses from public figures and MUST be re-fitted with
# `python bench/memory_check.py` on a real GPU (it prints the fitted values).

# CUDA context + loaded kernel images with lazy loading (CUDA >= 11.7), as `torch.cuda.mem_get_info`
# sees it after the first conv and matmul: ~300-500 MiB on recent drivers.
CUDA_CONTEXT_BYTES = 384 * MiB
# cuBLAS workspace (up to 32 MiB on Hopper) + the cuDNN convolution workspace live at the peak.
# Both come from the caching allocator on a real GPU; the trace cannot see them.
CUDA_WORKSPACE_BYTES = 64 * MiB
# max_memory_reserved / max_memory_allocated - 1: cached free blocks that cannot serve the next
# request (fragmentation) and segment rounding. 5-15 % is typical for CNN training.
ALLOCATOR_OVERHEAD_FRACTION = 0.08
# Caching-allocator granularity: every block is a multiple of 512 bytes; segments of 2 MiB.
BLOCK_BYTES = 512
SEGMENT_BYTES = 2 * MiB
# `plan` without a dataset: size the classifier head for ImageNet.
DEFAULT_NUM_CLASSES = 1000
# The two micro-batch sizes traced for the linear model (>= 2: BatchNorm refuses batch 1 on 1x1 maps).
_TRACE_BATCHES = (2, 4)

# ---------------------------------------------------------------------------------------------
# Public results


@dataclass
class MemoryEstimate:
    micro_batch: int
    params_bytes: int  # all parameters (fp32 master weights) + buffers (BatchNorm statistics)
    grads_bytes: int  # grads of trainable params (+ DDP buckets when num_processes > 1)
    optimizer_bytes: int  # AdamW: exp_avg + exp_avg_sq; SGD momentum: momentum_buffer
    activations_bytes: int  # alive at the peak, created in the forward (incl. the normalized input batch)
    temporaries_bytes: int  # alive at the peak, created in backward/step (+ autocast weight casts)
    cuda_context_bytes: int  # CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES
    allocator_overhead_bytes: int  # ALLOCATOR_OVERHEAD_FRACTION of the allocated peak, rounded
    peak_bytes: int  # predicted max_memory_reserved + context: what nvidia-smi would show
    precision: str = "no"  # resolved: no (fp32) | bf16 | fp16
    per_process_batch: int = 0
    accumulating: bool = False  # grads of earlier micro-batches already live during backward
    allocated_bytes: int = 0  # predicted torch.cuda.max_memory_allocated
    reserved_bytes: int = 0  # predicted torch.cuda.max_memory_reserved
    peak_phase: str = ""  # forward | backward | optimizer: where the peak happens

    def as_dict(self) -> dict:
        d = asdict(self)
        d["peak_gib"] = round(self.peak_bytes / GiB, 3)
        return d


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
_CUDA_ONLY = {"_cudnn_rnn", "cudnn_convolution", "cudnn_convolution_transpose", "linalg_matrix_sqrth"}

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
_CAT_NAMES = ["param", "buffer", "optimizer", "host", "input", "activation", "weight_cast",
              "backward", "step", "grad"]


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
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
class _Log:
    sizes: np.ndarray  # bytes per allocation (before rounding)
    cats: np.ndarray
    events: np.ndarray
    end_forward: int
    end_backward: int
    grads: np.ndarray  # allocation indices that are parameter .grad storages


# ---------------------------------------------------------------------------------------------
# Building the fake model and tracing one step


def resolve_precision(precision: str | None, cfg: Config | None = None) -> str:
    """`auto` plans as bf16 (what the trainer picks on any GPU with bf16); `fp32` means `no`."""
    p = precision or (cfg.train.precision if cfg is not None else "auto")
    p = {"auto": "bf16", "fp32": "no", "32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(p, p)
    if p not in ("no", "bf16", "fp16"):
        raise VramfitError(f"Unknown precision `{p}` for planning.", hint="use no, bf16, fp16 or auto")
    return p


def _build(cfg: Config, num_classes: int, fake_mode, on_meta: bool, model_fn=None):
    from .models import create_model
    from .optim import create_optimizer

    ctx = torch.device("meta") if on_meta else contextlib.nullcontext()
    with ctx:
        model = model_fn() if model_fn is not None else create_model(cfg.model, num_classes, load_weights=False)
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


class _Tracer:
    """A fake model + optimizer, traced at any micro-batch on demand."""

    def __init__(self, cfg: Config, num_classes: int, precision: str, model_fn=None):
        self.cfg, self.num_classes, self.precision, self.model_fn = cfg, num_classes, precision, model_fn
        self.build(on_meta=True)

    def build(self, on_meta: bool) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.model, self.optimizer, self.trainable = _build(self.cfg, self.num_classes, self.fake_mode, on_meta,
                                                            self.model_fn)
        self.on_meta = on_meta

    def trace(self, batch: int) -> _Log:
        with _TRACE_LOCK:  # gc and the autocast kernels are process-wide: one trace at a time
            return self._trace(batch)

    def _trace(self, batch: int) -> _Log:
        model, optimizer, trainable = self.model, self.optimizer, self.trainable
        lp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        fmt = torch.channels_last if self.cfg.model.channels_last else torch.contiguous_format
        rec = _Recorder({id(p) for p in model.parameters()})
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
        return _Log(sizes=np.array(rec.sizes, dtype=np.int64), cats=np.array(rec.cats, dtype=np.int64),
                    events=np.array(rec.events, dtype=np.int64), end_forward=rec.end_forward,
                    end_backward=rec.end_backward, grads=np.array(self._grad_indices, dtype=np.int64))

    def _step(self, rec, model, optimizer, trainable, batch, size, lp, fmt):
        """engine.train_step for one micro-batch, then clip + optimizer step + zero_grad."""
        tcfg = self.cfg.train
        # The normalized per-process batch (run.py: normalize(batch.images)) lives for the whole
        # step; micro-batches are views of it. Traced at `batch`, re-sized to the per-process batch
        # when evaluated (category INPUT).
        rec.phase = INPUT
        images = torch.empty((batch, 3, size, size), dtype=torch.float32, memory_format=fmt)
        labels = torch.zeros((batch,), dtype=torch.long)
        rec.phase = ACT
        if lp is not None:
            _CACHE.enabled, _CACHE.casts = True, {}
            with torch.autocast("cpu", dtype=lp):
                logits = model(images)
            _CACHE.enabled, _CACHE.casts = False, {}
            logits = logits.float()  # accelerate's convert_outputs_to_fp32
        else:
            logits = model(images)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum",
                                                 label_smoothing=tcfg.label_smoothing)
        rec.end_forward = len(rec.events)
        rec.phase = BWD
        scaled = loss / batch
        if self.precision == "fp16":
            scaled = scaled * 65536.0  # GradScaler.scale
        if scaled.requires_grad:  # (everything frozen: nothing to do)
            scaled.backward()
        del scaled
        loss_sum = loss.detach()
        correct = (logits.detach().argmax(1) == labels).sum()
        del logits, loss, correct, loss_sum
        rec.end_backward = len(rec.events)
        self._grad_indices = [i for i in (rec.index_of(p.grad) for p in trainable if p.grad is not None)
                              if i is not None]
        rec.phase = STEP
        if self.precision == "fp16":  # GradScaler.unscale_: in place
            torch._foreach_mul_([p.grad for p in trainable if p.grad is not None], 1.0 / 65536.0)
        if tcfg.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(trainable, tcfg.clip_grad_norm)
        if trainable:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del images, labels


# ---------------------------------------------------------------------------------------------
# The profile: allocation sizes as a function of the micro-batch


def _round_blocks(sizes: np.ndarray) -> np.ndarray:
    return np.where(sizes > 0, -(-sizes // BLOCK_BYTES) * BLOCK_BYTES, 0)


@dataclass
class _Peak:
    allocated: int
    by_cat: np.ndarray  # bytes per category at the peak
    phase: str


class _Profile:
    """Per-allocation sizes `a + b * micro_batch`, from two traces; exact fallback otherwise."""

    def __init__(self, cfg: Config, num_classes: int, precision: str, model_fn=None):
        t0 = time.perf_counter()
        self.tracer = _Tracer(cfg, num_classes, precision, model_fn)
        b1, b2 = _TRACE_BATCHES
        try:
            l1 = self.tracer.trace(b1)
        except VramfitError:
            raise
        except Exception:  # noqa: BLE001
            # Models that compute with tensor data at init, or keep plain tensor attributes, cannot
            # be built on the meta device: build them for real (slower), then trace the same way.
            try:
                self.tracer.build(on_meta=False)
                l1 = self.tracer.trace(b1)
            except VramfitError:
                raise
            except Exception as e:  # noqa: BLE001
                raise VramfitError(
                    f"Could not run one training step of `{cfg.model.name}` at {cfg.data.image_size} px "
                    f"to plan its memory: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                    hint="the trainer would fail the same way; check that the model accepts this "
                         "image size (e.g. ViTs need their native size) and the model.* settings") from None
        l2 = self.tracer.trace(b2)
        self.linear = (len(l1.sizes) == len(l2.sizes) and np.array_equal(l1.events, l2.events)
                       and np.array_equal(l1.cats, l2.cats) and np.array_equal(l1.grads, l2.grads)
                       and l1.end_backward == l2.end_backward and l1.end_forward == l2.end_forward
                       and not np.any((l2.sizes - l1.sizes) % (b2 - b1)))
        if self.linear:
            self.slope = (l2.sizes - l1.sizes) // (b2 - b1)
            self.const = l1.sizes - self.slope * b1
            self.log = l1
        self._exact: dict[int, _Log] = {b1: l1, b2: l2}
        self.trace_seconds = time.perf_counter() - t0
        self.num_params = sum(p.numel() for p in self.tracer.model.parameters())
        self.num_trainable = sum(p.numel() for p in self.tracer.trainable)
        self.trainable_bytes = int(_round_blocks(np.array(
            [p.numel() * p.element_size() for p in self.tracer.trainable], dtype=np.int64)).sum())

    def _log_at(self, micro: int) -> tuple[_Log, np.ndarray]:
        if self.linear:
            return self.log, self.const + self.slope * micro
        if micro not in self._exact:
            self._exact[micro] = self.tracer.trace(micro)
        log = self._exact[micro]
        return log, log.sizes

    def peak(self, micro: int, per_process: int, accumulating: bool) -> _Peak:
        return self._evaluate(micro, per_process, accumulating)[0]

    def live_at_end_of_forward(self, micro: int, per_process: int | None = None) -> np.ndarray:
        """Bytes per category alive when the forward (and loss) is done: the saved activations."""
        return self._evaluate(micro, per_process or micro, False)[1]

    def _evaluate(self, micro: int, per_process: int, accumulating: bool) -> tuple[_Peak, np.ndarray]:
        log, sizes = self._log_at(micro)
        sizes = sizes.copy()
        # The input batch (images, labels) is the per-process batch; micro-batches are views of it.
        inputs = log.cats == INPUT
        sizes[inputs] = sizes[inputs] // micro * per_process
        sizes[log.cats == HOST] = 0  # optimizer step counters live on the host
        sizes = _round_blocks(sizes)
        cats = log.cats.copy()
        cats[log.grads] = GRAD
        ev = log.events
        alloc = ev >= 0
        idx = np.where(alloc, ev, ~ev)
        delta = np.where(alloc, sizes[idx], -sizes[idx])
        ev_cat = cats[idx]
        is_grad = ev_cat == GRAD
        nongrad = np.where(is_grad, 0, delta)
        grad_live = np.cumsum(np.where(is_grad, delta, 0))
        if accumulating and len(log.grads):
            # Micro-batches after the first: every grad already exists during forward/backward, and
            # AccumulateGrad adds each new grad in place (the new grad is a one-op temporary).
            before = np.arange(len(ev)) < log.end_backward
            all_grads = int(sizes[log.grads].sum())
            transient = np.where(before & is_grad & alloc, delta, 0)
            grad_term = np.where(before, all_grads + transient, grad_live)
        else:
            grad_term = grad_live
        live = np.cumsum(nongrad) + grad_term
        k = int(np.argmax(live))
        by_cat = np.zeros(len(_CAT_NAMES), dtype=np.int64)
        np.add.at(by_cat, ev_cat[: k + 1], nongrad[: k + 1])
        by_cat[GRAD] = int(grad_term[k])
        if k >= log.end_backward:
            phase = "optimizer"
        elif np.any(alloc[: k + 1] & (ev_cat[: k + 1] == BWD)):
            phase = "backward"
        else:
            phase = "forward"
        at_fwd = np.zeros(len(_CAT_NAMES), dtype=np.int64)
        np.add.at(at_fwd, ev_cat[: log.end_forward], delta[: log.end_forward])
        return _Peak(allocated=int(live[k]), by_cat=by_cat, phase=phase), at_fwd


_PROFILES: dict[str, _Profile] = {}
_PROFILE_LOCK = threading.Lock()


def _profile_key(cfg: Config, num_classes: int, precision: str) -> str:
    t = cfg.train
    return json.dumps([cfg.model.model_dump(mode="json"), cfg.optim.model_dump(mode="json"),
                       cfg.data.image_size, num_classes, precision, bool(t.clip_grad_norm),
                       t.label_smoothing > 0], sort_keys=True)


def _get_profile(cfg: Config, num_classes: int, precision: str) -> _Profile:
    key = _profile_key(cfg, num_classes, precision)
    with _PROFILE_LOCK:
        prof = _PROFILES.get(key)
        if prof is None:
            prof = _Profile(cfg, num_classes, precision)
            if len(_PROFILES) >= 32:
                _PROFILES.pop(next(iter(_PROFILES)))
            _PROFILES[key] = prof
        return prof


# ---------------------------------------------------------------------------------------------
# API


def _reserved(allocated: int) -> int:
    return int(math.ceil(allocated * (1 + ALLOCATOR_OVERHEAD_FRACTION) / SEGMENT_BYTES) * SEGMENT_BYTES)


def _estimate_from(prof: _Profile, micro: int, per_process: int, num_processes: int,
                   precision: str) -> MemoryEstimate:
    per_process = max(per_process, micro)
    pk = prof.peak(micro, per_process, accumulating=micro < per_process)
    c = pk.by_cat
    ddp = prof.trainable_bytes if num_processes > 1 else 0  # DDP's gradient buckets
    allocated = pk.allocated + ddp
    reserved = _reserved(allocated)
    context = CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES
    return MemoryEstimate(
        micro_batch=micro,
        params_bytes=int(c[PARAM] + c[BUFFER]),
        grads_bytes=int(c[GRAD]) + ddp,
        optimizer_bytes=int(c[OPT]),
        activations_bytes=int(c[INPUT] + c[ACT]),
        temporaries_bytes=int(c[WCAST] + c[BWD] + c[STEP]),
        cuda_context_bytes=context,
        allocator_overhead_bytes=reserved - allocated,
        peak_bytes=reserved + context,
        precision=precision,
        per_process_batch=per_process,
        accumulating=micro < per_process,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        peak_phase=pk.phase,
    )


def _per_process(cfg: Config, num_processes: int, per_process_batch: int | None) -> int:
    if per_process_batch is not None:
        return per_process_batch
    return max(1, cfg.train.global_batch // max(1, num_processes))


def estimate(cfg: Config, num_classes: int, micro_batch: int, precision: str | None = None, *,
             num_processes: int = 1, per_process_batch: int | None = None) -> MemoryEstimate:
    """Predicted memory of one steady-state step at `micro_batch` (see MemoryEstimate).

    `precision` None -> cfg.train.precision; `auto` plans as bf16. The per-process batch (default
    global_batch / num_processes) sizes the input batch and says whether gradients accumulate.
    """
    if micro_batch < 1:
        raise VramfitError(f"micro_batch must be >= 1, got {micro_batch}")
    prec = resolve_precision(precision, cfg)
    prof = _get_profile(cfg, num_classes, prec)
    return _estimate_from(prof, micro_batch, _per_process(cfg, num_processes, per_process_batch),
                          num_processes, prec)


def estimate_model(model_fn, cfg: Config, micro_batch: int, precision: str | None = None, *,
                   per_process_batch: int | None = None) -> MemoryEstimate:
    """`estimate` for any `nn.Module` built by `model_fn()` (not cached; used by the tests to check
    the trace against hand counts). The model must take (N, 3, image_size, image_size) images."""
    prec = resolve_precision(precision, cfg)
    prof = _Profile(cfg, 0, prec, model_fn)
    return _estimate_from(prof, micro_batch, _per_process(cfg, 1, per_process_batch), 1, prec)


def estimate_table(cfg: Config, num_classes: int, micro_batches: list[int], precision: str | None = None, *,
                   num_processes: int = 1, per_process_batch: int | None = None) -> list[MemoryEstimate]:
    """One estimate per micro-batch, from one traced model (two traces in all)."""
    prec = resolve_precision(precision, cfg)
    prof = _get_profile(cfg, num_classes, prec)
    per = _per_process(cfg, num_processes, per_process_batch)
    return [_estimate_from(prof, m, per, num_processes, prec) for m in micro_batches]


def pick_micro_batch(cfg: Config, num_classes: int, per_process_batch: int, budget_bytes: int, *,
                     precision: str | None = None, num_processes: int = 1
                     ) -> tuple[int | None, list[MemoryEstimate]]:
    """Largest divisor of the per-process batch whose predicted peak fits `budget_bytes`.

    Returns (micro_batch or None when even 1 does not fit, the estimates of every divisor tried).
    """
    divs = _divisors(per_process_batch)
    table = estimate_table(cfg, num_classes, divs, precision, num_processes=num_processes,
                           per_process_batch=per_process_batch)
    fits = [e.micro_batch for e in table if e.peak_bytes <= budget_bytes]
    return (max(fits) if fits else None), table


def budget_bytes_for(cfg: Config, memory_gib: float | None = None) -> int | None:
    gib = memory_gib if memory_gib is not None else cfg.hardware.memory_gib
    if gib is None:
        return None
    return int(gib * GiB * (1 - cfg.hardware.safety_margin))


# ---------------------------------------------------------------------------------------------
# Advice


_FAMILIES: list[list[str]] = [
    ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnet200"],
    ["resnet18d", "resnet34d", "resnet50d", "resnet101d", "resnet152d", "resnet200d"],
    ["resnext26ts", "resnext50_32x4d", "resnext101_32x8d"],
    ["wide_resnet50_2", "wide_resnet101_2"],
    [f"efficientnet_b{i}" for i in range(9)],
    [f"tf_efficientnet_b{i}" for i in range(9)],
    ["efficientnetv2_rw_t", "efficientnetv2_rw_s", "efficientnetv2_rw_m"],
    ["tf_efficientnetv2_b0", "tf_efficientnetv2_b1", "tf_efficientnetv2_b2", "tf_efficientnetv2_b3",
     "tf_efficientnetv2_s", "tf_efficientnetv2_m", "tf_efficientnetv2_l", "tf_efficientnetv2_xl"],
    ["convnext_atto", "convnext_femto", "convnext_pico", "convnext_nano", "convnext_tiny",
     "convnext_small", "convnext_base", "convnext_large", "convnext_xlarge", "convnext_xxlarge"],
    ["convnextv2_atto", "convnextv2_femto", "convnextv2_pico", "convnextv2_nano", "convnextv2_tiny",
     "convnextv2_base", "convnextv2_large", "convnextv2_huge"],
    ["mobilenetv3_small_100", "mobilenetv3_large_100"],
    ["regnety_002", "regnety_004", "regnety_008", "regnety_016", "regnety_032", "regnety_040",
     "regnety_064", "regnety_080", "regnety_120", "regnety_160", "regnety_320"],
    ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224",
     "vit_huge_patch14_224"],
]


def lighter_backbones(name: str, n: int = 2) -> list[str]:
    """Up to `n` smaller members of the model's family, nearest first (resnet50 -> resnet34, resnet18;
    efficientnet_b3 -> b2, b0). The weight tag is dropped: timm's default weights of each."""
    arch = name.split(".", 1)[0]
    for fam in _FAMILIES:
        if arch in fam:
            smaller = fam[: fam.index(arch)][::-1]
            if len(smaller) > n:  # nearest, then the smallest (the biggest step down)
                smaller = smaller[: n - 1] + [smaller[-1]]
            return smaller
    return []


def _freeze_options(cfg: Config, num_classes: int) -> list[list[str]]:
    """Parameter-name prefixes that freeze the stem + first stage, and the stem + two stages."""
    from .models import create_model

    with torch.device("meta"):
        try:
            model = create_model(cfg.model.model_copy(update={"freeze": []}), num_classes, load_weights=False)
        except Exception:  # noqa: BLE001
            return []
    info = [f.get("module") for f in getattr(model, "feature_info", []) or [] if f.get("module")]
    names = [n for n, _ in model.named_parameters()]
    out: list[list[str]] = []
    for k in (1, 2):  # keep at least two stages and the head trainable
        if len(info) <= k + 1:
            break
        end = info[k]
        last = max((i for i, n in enumerate(names) if n.startswith(end + ".")), default=None)
        if last is None:
            continue
        prefixes: list[str] = []
        for n in names[: last + 1]:
            stage = [m for m in info if n.startswith(m + ".")]
            parts = n.split(".")
            p = max(stage, key=len) if stage else (
                ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0])
            if p not in prefixes:
                prefixes.append(p)
        if prefixes not in out:
            out.append(prefixes)
    return out


def _requested_micro(cfg: Config, per_process: int) -> int | None:
    mb = cfg.train.micro_batch
    if isinstance(mb, int):
        return min(mb, per_process)
    return per_process if mb is None else None  # run.py: None = whole share at once; auto = pick


def _with(cfg: Config, sets: dict[str, Any]) -> Config:
    data = cfg.model_dump()
    for dotted, value in sets.items():
        node = data
        *path, last = dotted.split(".")
        for k in path:
            node = node[k]
        node[last] = value
    return Config.model_validate(data)


def advise(cfg: Config, num_classes: int, per_process_batch: int, budget_bytes: int, *,
           num_processes: int = 1) -> list[dict]:
    """When the configured step does not fit: the cheapest changes that make it fit.

    Each option fits `budget_bytes` at the micro-batch it names; sorted by what it costs the user
    (same maths first, then speed, then what is trained, then the model itself).
    """
    requested = _requested_micro(cfg, per_process_batch)
    pick, _ = pick_micro_batch(cfg, num_classes, per_process_batch, budget_bytes, num_processes=num_processes)
    if pick is not None and (requested is None or requested <= pick):
        return []
    prec = resolve_precision(None, cfg)
    singles: list[tuple[float, str, dict, str]] = []
    if prec == "no":
        singles.append((1, "bf16 autocast", {"train.precision": "bf16"},
                        "activations in 16 bit; needs an Ampere or newer GPU (RTX 30xx/40xx, A100, H100)"))
        singles.append((2, "fp16 autocast", {"train.precision": "fp16"},
                        "any CUDA GPU; loss scaling, rare skipped steps"))
    if not cfg.model.grad_checkpointing:
        singles.append((3, "gradient checkpointing", {"model.grad_checkpointing": True},
                        "recomputes the forward in backward: ~20-30% slower, same maths"))
    if not cfg.model.freeze:
        for j, prefixes in enumerate(_freeze_options(cfg, num_classes)):
            singles.append((4 + j, f"freeze {', '.join(prefixes)}", {"model.freeze": prefixes},
                            "early stages keep their (pretrained) weights; changes what is trained"))
    for j, name in enumerate(lighter_backbones(cfg.model.name)):
        singles.append((6 + j, f"lighter backbone {name}", {"model.name": name},
                        "a different model: expect lower accuracy"))

    out: list[dict] = []

    def option(cost: float, change: str, sets: dict, why: str, est: MemoryEstimate) -> dict:
        return {"change": change, "set": {**sets, "train.micro_batch": est.micro_batch}, "cost": cost,
                "why": why, "micro_batch": est.micro_batch,
                "grad_accum_steps": per_process_batch // est.micro_batch,
                "peak_bytes": est.peak_bytes, "peak_gib": round(est.peak_bytes / GiB, 2)}

    def consider(cost: float, change: str, sets: dict, why: str) -> bool:
        try:
            p, table = pick_micro_batch(_with(cfg, sets), num_classes, per_process_batch, budget_bytes,
                                        num_processes=num_processes)
        except Exception:  # noqa: BLE001 - a variant this model cannot take is simply not offered
            return False
        if p is None:
            return False
        out.append(option(cost, change, sets, why, next(e for e in table if e.micro_batch == p)))
        return True

    if pick is not None:  # the configured micro-batch is too big, a smaller one fits: free
        est = estimate(cfg, num_classes, pick, num_processes=num_processes, per_process_batch=per_process_batch)
        out.append(option(0, f"micro-batch {pick} x {per_process_batch // pick} accumulation steps", {},
                          "same maths, same model; only slower per sample", est))
    for cost, change, sets, why in singles:
        consider(cost, change, sets, why)

    if not [o for o in out if o["cost"] > 0]:
        # Nothing alone fits at any micro-batch: stack the changes, cheapest first.
        stacked: dict = {}
        names, total = [], 0.0
        for cost, change, sets, why in singles:
            if any(k in stacked for k in sets):
                continue  # one precision, one freeze list, one backbone
            stacked.update(sets)
            names.append(change)
            total += cost
            if len(names) > 1 and consider(total, " + ".join(names), dict(stacked),
                                           "no single change is enough"):
                break
    out.sort(key=lambda o: (o["cost"], -o["micro_batch"]))
    return out


# ---------------------------------------------------------------------------------------------
# `vramfit plan`


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f}"


def _table_sizes(per_process: int) -> list[int]:
    sizes = set(_divisors(per_process))
    p = 1
    while p <= per_process:
        sizes.add(p)
        p *= 2
    return sorted(sizes)


def run_plan(cfg: Config, num_classes: int, num_processes: int = 1, memory_gib: float | None = None,
             micro_batch: int | None = None, as_json: bool = False, out=None) -> dict:
    """What `vramfit plan` prints (to `out`, default sys.stdout); returns the same content as a
    dict (--json and plan.json; its `text` key holds the printed text)."""
    from .config import per_process_batch as _ppb

    t0 = time.perf_counter()
    per_proc = _ppb(cfg.train.global_batch, num_processes)
    prec = resolve_precision(None, cfg)
    budget = budget_bytes_for(cfg, memory_gib)
    gib = memory_gib if memory_gib is not None else cfg.hardware.memory_gib
    sizes = _table_sizes(per_proc)
    table = estimate_table(cfg, num_classes, sizes, num_processes=num_processes, per_process_batch=per_proc)
    by_micro = {e.micro_batch: e for e in table}

    pick = None
    if budget is not None:
        fits = [m for m in _divisors(per_proc) if by_micro[m].peak_bytes <= budget]
        pick = max(fits) if fits else None
    # Same rules as run.py: a configured micro-batch larger than this process's share runs the share
    # at once (a single-GPU recipe on 8 GPUs); `auto` picks; none means the whole share at once.
    requested = micro_batch if micro_batch is not None else cfg.train.micro_batch
    if isinstance(requested, int) and requested >= per_proc:
        chosen, how = per_proc, ("configured" if requested == per_proc else f"{requested} > per-process batch")
    elif isinstance(requested, int):
        from .config import grad_accum_steps
        grad_accum_steps(cfg.train.global_batch, requested, num_processes)  # must divide (raises with a hint)
        chosen, how = requested, ("configured" if requested == cfg.train.micro_batch else "given")
    elif requested == "auto" and budget is not None:
        chosen, how = (pick or 1), "picked"
    else:
        chosen, how = per_proc, "whole per-process batch"
    if chosen not in by_micro:
        by_micro[chosen] = estimate(cfg, num_classes, chosen, num_processes=num_processes,
                                    per_process_batch=per_proc)
    est = by_micro[chosen]
    fits_chosen = None if budget is None else est.peak_bytes <= budget
    advice = []
    if budget is not None and not fits_chosen:
        asked = _with(cfg, {"train.micro_batch": chosen}) if isinstance(requested, int) else cfg
        advice = advise(asked, num_classes, per_proc, budget, num_processes=num_processes)
    prof = _get_profile(cfg, num_classes, prec)

    result: dict[str, Any] = {
        "model": cfg.model.name, "image_size": cfg.data.image_size, "num_classes": num_classes,
        "precision": prec, "requested_precision": cfg.train.precision, "optimizer": cfg.optim.name,
        "grad_checkpointing": cfg.model.grad_checkpointing, "channels_last": cfg.model.channels_last,
        "freeze": list(cfg.model.freeze), "num_params": prof.num_params, "num_trainable": prof.num_trainable,
        "all_grads_bytes": prof.trainable_bytes,
        "global_batch": cfg.train.global_batch, "num_processes": num_processes, "per_process_batch": per_proc,
        "memory_gib": gib, "safety_margin": cfg.hardware.safety_margin, "budget_bytes": budget,
        "micro_batch": chosen, "micro_batch_source": how, "grad_accum_steps": per_proc // chosen,
        "fits": fits_chosen, "pick": pick, "predicted_peak_bytes": est.peak_bytes,
        "estimate": est.as_dict(),
        "table": [{"micro_batch": e.micro_batch, "peak_bytes": e.peak_bytes,
                   "peak_gib": round(e.peak_bytes / GiB, 2), "divides": per_proc % e.micro_batch == 0,
                   "fits": None if budget is None else e.peak_bytes <= budget} for e in table],
        "advice": advice,
        "constants": {"cuda_context_bytes": CUDA_CONTEXT_BYTES, "cuda_workspace_bytes": CUDA_WORKSPACE_BYTES,
                      "allocator_overhead_fraction": ALLOCATOR_OVERHEAD_FRACTION, "block_bytes": BLOCK_BYTES},
        "method": "fake-tensor trace of one step, linear in micro-batch" if prof.linear
                  else "fake-tensor trace of one step per micro-batch",
        "planner_seconds": None,
    }
    result["planner_seconds"] = round(time.perf_counter() - t0, 2)
    result["text"] = format_plan(result)
    out = out if out is not None else sys.stdout
    if as_json:
        out.write(json.dumps({k: v for k, v in result.items() if k != "text"}, indent=1) + "\n")
    else:
        out.write(result["text"] + "\n")
    return result


_LINES = [
    ("params_bytes", "parameters", "fp32 weights of every layer (+ BatchNorm statistics)"),
    ("grads_bytes", "gradients", "fp32, trainable parameters only"),
    ("optimizer_bytes", "optimizer state", None),
    ("activations_bytes", "activations", "saved by the forward for backward, + the input batch"),
    ("temporaries_bytes", "temporaries", "backward/step working memory alive at the peak"),
    ("allocator_overhead_bytes", "allocator", None),
    ("cuda_context_bytes", "CUDA context", "context + cuBLAS/cuDNN workspaces (constant)"),
]


def _set_arg(key: str, value: Any) -> str:
    """`key=value` as `--set` parses it (YAML), quoted for the shell where needed."""
    if isinstance(value, list):
        arg = f"{key}=[{','.join(str(v) for v in value)}]"
        return f"'{arg}'"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={value}"


def format_plan(r: dict) -> str:
    e = r["estimate"]
    prec = {"no": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}[r["precision"]]
    opt_note = ("AdamW: exp_avg + exp_avg_sq per trainable weight" if r["optimizer"] == "adamw"
                else "SGD: momentum buffer per trainable weight")
    extras = [x for x in (("grad checkpointing" if r["grad_checkpointing"] else ""),
                          ("channels_last" if r["channels_last"] else ""),
                          (f"frozen: {', '.join(r['freeze'])}" if r["freeze"] else "")) if x]
    lines = [
        f"vramfit plan: {r['model']} @ {r['image_size']}px, {prec}, {r['optimizer']}, {r['num_classes']} classes"
        + (f", {', '.join(extras)}" if extras else ""),
        f"  {r['num_params'] / 1e6:.1f} M parameters ({r['num_trainable'] / 1e6:.1f} M trainable); "
        f"per-process batch {r['per_process_batch']} = global {r['global_batch']} / {r['num_processes']} process(es)",
    ]
    if r["budget_bytes"] is not None:
        lines.append(f"  budget {_gib(r['budget_bytes'])} GiB = {r['memory_gib']:g} GiB x (1 - "
                     f"{r['safety_margin']:g} safety margin)")
    else:
        lines.append("  no memory budget (set hardware.memory_gib or --memory-gib to pick a micro-batch)")
    verdict = "" if r["fits"] is None else ("  fits" if r["fits"] else "  DOES NOT FIT")
    lines.append(f"micro-batch {r['micro_batch']} ({r['micro_batch_source']}) x {r['grad_accum_steps']} "
                 f"accumulation step(s): predicted peak {_gib(e['peak_bytes'])} GiB{verdict}")
    for key, label, note in _LINES:
        if key == "optimizer_bytes":
            note = opt_note
        if key == "grads_bytes" and e["grads_bytes"] < r["all_grads_bytes"]:
            note += f"; {_gib(r['all_grads_bytes'])} GiB once all exist (the peak comes before)"
        if key == "allocator_overhead_bytes":
            note = f"caching-allocator rounding/fragmentation ({ALLOCATOR_OVERHEAD_FRACTION:.0%} of allocated)"
        lines.append(f"  {label:<16}{_gib(e[key]):>7} GiB  {note}")
    lines.append(f"  {'peak':<16}{_gib(e['peak_bytes']):>7} GiB  what nvidia-smi would show "
                 f"(peak during {e['peak_phase']}; allocated {_gib(e['allocated_bytes'])} GiB)")
    lines.append("micro-batch -> predicted peak")
    for row in r["table"]:
        mark = "" if row["divides"] else "  (does not divide the batch)"
        fit = "" if row["fits"] is None else ("  fits" if row["fits"] else "  too big")
        star = " <" if row["micro_batch"] == r["micro_batch"] else ""
        lines.append(f"  {row['micro_batch']:>6}  {row['peak_gib']:>7.2f} GiB{fit}{mark}{star}")
    if r["budget_bytes"] is not None:
        if r["pick"] is None:
            lines.append("pick: none -- even micro-batch 1 does not fit")
        else:
            lines.append(f"pick: micro-batch {r['pick']} ({r['per_process_batch'] // r['pick']} accumulation "
                         f"step(s)), the largest divisor of {r['per_process_batch']} that fits")
    if r["advice"]:
        lines.append("to make it fit (cheapest first):")
        for a in r["advice"]:
            sets = " ".join(f"--set {_set_arg(k, v)}" for k, v in a["set"].items())
            lines.append(f"  {a['change']:<44} micro-batch {a['micro_batch']:>4}  peak {a['peak_gib']:.2f} GiB"
                         f"  ({a['why']})\n      {sets}")
    elif r["fits"] is False:
        lines.append("no single change found that fits; try a smaller data.image_size")
    return "\n".join(lines)
