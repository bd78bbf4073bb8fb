"""The speed-target cases (target_cases), measured into records (records): the two sides of a
ratio timed together as the matrix's columns are (measure.measure_interleaved: CUDA events,
warm-up, L2 flush, interleaved rounds, median, retakes; the training step's two models too), the
host cost by timing.host_cost_us with the sides' loops in turn, and the small model by
timing.benchmark (prefill) and the wall clock around whole generations (decode). The loss target
trains its two models and records their losses (no timing). A side that refuses or fails becomes
a NotMeasured record, never a raise.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..cases import DRAW_ON_CPU_MAX_BYTES, DTYPES, ELEMENT_BYTES, Case, make_inputs
from ..gates.ragged import case_seed
from . import measure
from .baselines import ops, sdpa_supports_gqa
from .records import (
    HostCost,
    HostRecord,
    LossRecord,
    LossRun,
    Measured,
    ModelRecord,
    ModelTiming,
    NotMeasured,
    PagedRecord,
    ReadFloor,
    StepRecord,
    TargetRecord,
    VarlenRecord,
)
from .stats import sig
from .target_cases import (
    HOST_VARLEN_LENGTHS,
    HostTarget,
    LossTarget,
    ModelTarget,
    PagedTarget,
    StepTarget,
    VarlenTarget,
)
from .timing import TimingConfig, benchmark, first_line, host_cost_us

HOST_LOOPS = 4  # loops a side, ours and SDPA's in turn (measure.in_turn): an even count
# Shuffled page orders a paged target is timed in (seeds case_seed + 0, 1, ...), in the same rounds;
# its paged side is the order of median time. One order's time moves with the seed by as much as a
# target's margin (benches/notes/varlen-paged.md, v4.3): a verdict from one order is partly the
# luck of its permutation. An odd count.
PAGE_ORDERS = 3
MODEL_RUNS = 3  # timed generations per length (after one untimed), the median kept
CUDA_ONLY_HOST = (
    "the host cost is measured with CUDA events around calls that queue GPU work; on the CPU "
    "backend every call does its work before returning, so there is no host overhead to isolate"
)
CUDA_ONLY_MODEL = "the model case times a bf16 model on CUDA; run it on a GPU machine"


def _randn(shape: tuple[int, ...], dtype: str, device: str, seed: int) -> torch.Tensor:
    """torch.randn drawn where cases.make_inputs draws: on the CPU up to DRAW_ON_CPU_MAX_BYTES."""
    numel = 1
    for n in shape:
        numel *= n
    on_cpu = numel * ELEMENT_BYTES <= DRAW_ON_CPU_MAX_BYTES
    generator = torch.Generator(device="cpu" if on_cpu else device).manual_seed(seed)
    if on_cpu:
        return torch.randn(shape, generator=generator).to(device=device, dtype=DTYPES[dtype])
    return torch.randn(shape, generator=generator, device=device, dtype=DTYPES[dtype])


def cumulative(lengths, device: str) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------------------------------
# Varlen against dense
# --------------------------------------------------------------------------------------------------


def varlen_calls(
    target: VarlenTarget, device: str
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the packed call, the dense calls): flash_attention_varlen_forward on the packed batch, and
    flash_attention_forward once per distinct length on those sequences stacked as [n, H, L, D]
    (the dense kernel's own layout), run back to back in one callable; both with the target's
    window."""
    lengths = target.lengths
    seed = case_seed(target.id)
    q = _randn((target.total, target.heads_q, target.head_dim), target.dtype, device, seed)
    k = _randn((target.total, target.heads_kv, target.head_dim), target.dtype, device, seed + 1)
    v = _randn((target.total, target.heads_kv, target.head_dim), target.dtype, device, seed + 2)
    cu = cumulative(lengths, device)
    starts = cu.tolist()[:-1]
    groups = []
    for length in sorted(set(lengths)):
        rows = [s for s, n in zip(starts, lengths, strict=True) if n == length]

        def stack(t, rows=rows, length=length):
            return torch.stack([t[s : s + length] for s in rows]).transpose(1, 2).contiguous()

        groups.append((stack(q), stack(k), stack(v)))
    api, causal, longest, window = ops(), target.causal, max(lengths), target.window

    def packed():
        return api.flash_attention_varlen_forward(
            q, k, v, cu, cu, longest, longest, causal, window_size=window
        )

    def dense():
        return [
            api.flash_attention_forward(qg, kg, vg, causal, window_size=window)
            for qg, kg, vg in groups
        ]

    return packed, dense


def _side_by_side(calls: dict, target, device: str, timer, config, ceilings, say=None) -> dict:
    """Each of calls {name: fn} timed as a matrix case's columns are, as {name: result} in calls'
    order: in measure.ROUNDS interleaved rounds, retaken while disturbed (each retake said through
    `say`), so drift during the target hits both sides of its ratio alike (timed one after the
    other, a drift of a few percent is the size of a target's margin)."""
    return measure.measure_interleaved(
        {name: (fn, None) for name, fn in calls.items()},
        target,
        device,
        timer,
        config,
        ceilings,
        measure.ROUNDS,
        say=say,
    )


def run_varlen(
    target: VarlenTarget, device: str, timer, config, ceilings, say=None
) -> VarlenRecord:
    packed, dense = varlen_calls(target, device)
    ours, baseline = _side_by_side(
        {"varlen": packed, "dense": dense}, target, device, timer, config, ceilings, say
    ).values()
    return _record(
        VarlenRecord,
        target,
        ours=_without_samples(ours),
        dense=_without_samples(baseline),
        ratio=_time_ratio(baseline, ours),
        window=list(target.window) if target.window != (-1, -1) else None,
    )


# --------------------------------------------------------------------------------------------------
# Paged against contiguous decode
# --------------------------------------------------------------------------------------------------


def paged_cache(
    k: torch.Tensor, v: torch.Tensor, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contents of contiguous caches k, v [B, Hkv, S, D] as paged caches [B*S/block_size,
    block_size, Hkv, D] whose pages lie in a shuffled order, and the block table (int32) that
    finds them: sequence b's j-th block is k_cache[table[b, j]]."""
    batch, heads, seqlen, dim = k.shape
    blocks = seqlen // block_size
    order = torch.randperm(batch * blocks, generator=torch.Generator().manual_seed(seed))
    order = order.to(k.device)

    def paged(t: torch.Tensor) -> torch.Tensor:
        pages = t.transpose(1, 2).reshape(batch * blocks, block_size, heads, dim)
        cache = torch.empty_like(pages)
        cache[order] = pages
        return cache

    return paged(k), paged(v), order.view(batch, blocks).to(torch.int32)


def _record(cls, target, **measured):
    """A record of `cls`: the fields that describe the case, from the target's attributes of the
    same name (tuples as lists, as JSON reads them back), then the measured ones."""
    described = {}
    for field in dataclasses.fields(cls):
        if field.name not in measured:
            value = getattr(target, field.name)
            described[field.name] = list(value) if isinstance(value, tuple) else value
    return cls(**described, **measured)


def _floor_ratio(floor, result) -> float | None:
    if isinstance(floor, ReadFloor) and isinstance(result, Measured) and result.median_ms:
        return sig(floor.median_ms / result.median_ms, 4)
    return None


def paged_decode_call(
    x, block_size: int, seed: int, cache_seqlens=None, causal: bool = True
) -> Callable[[], object]:
    """Our decode of x.q against x.k and x.v's contents in a paged cache of block_size-key pages
    in a shuffled order (paged_cache): the call, ready to time or trace."""
    k_cache, v_cache, table = paged_cache(x.k, x.v, block_size, seed)
    api = ops()
    return lambda: api.flash_attention_decode(
        x.q, k_cache, v_cache, cache_seqlens, causal=causal, block_table=table
    )


def median_order(results: list) -> Measured | NotMeasured:
    """The paged side from its page orders' results: the order of median time, or the first order
    that was not measured (a failure in any order is the side's failure, never hidden)."""
    failed = [r for r in results if not isinstance(r, Measured)]
    if failed:
        return failed[0]
    return sorted(results, key=lambda r: r.median_ms)[len(results) // 2]


def run_paged(target: PagedTarget, device: str, timer, config, ceilings, say=None) -> PagedRecord:
    case = target.contiguous
    x = make_inputs(case, device)
    seed = case_seed(target.id)
    orders = {
        f"paged, order {i + 1}": paged_decode_call(x, target.block_size, seed + i)
        for i in range(PAGE_ORDERS)
    }
    api = ops()

    def contiguous():
        return api.flash_attention_decode(x.q, x.k, x.v)

    calls = {**orders, "contiguous": contiguous}
    if device == "cuda":  # the floor in the same interleaved rounds as both sides
        alongside = {name: (fn, None) for name, fn in calls.items()}
        floor, timed = measure.read_floor(
            case, x, device, timer, config, say=say, alongside=alongside, ceilings=ceilings
        )
    else:
        floor = None
        timed = _side_by_side(calls, target, device, timer, config, ceilings, say)
    per_order = [timed[name] for name in orders]
    ours, flat = median_order(per_order), timed["contiguous"]
    return _record(
        PagedRecord,
        target,
        ours=_without_samples(ours),
        contiguous=_without_samples(flat),
        read_floor=floor,
        ratio=_time_ratio(flat, ours),
        floor_ratio=_floor_ratio(floor, ours),
        contiguous_floor_ratio=_floor_ratio(floor, flat),
        orders_ms=[r.median_ms if isinstance(r, Measured) else None for r in per_order],
    )


# --------------------------------------------------------------------------------------------------
# Host cost
# --------------------------------------------------------------------------------------------------


def _sdpa_gqa(q, k, v, **kwargs):
    """SDPA's GQA call: enable_gqa where this torch has it, else K and V expanded (outside)."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)
    if sdpa_supports_gqa():
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)


def padded_batch(packed: torch.Tensor, lengths, width: int) -> torch.Tensor:
    """Packed rows [total, H, D] as a right-padded batch [B, H, width, D] (zeros past each end)."""
    out = packed.new_zeros(len(lengths), width, *packed.shape[1:])
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = packed[start : start + n]
        start += n
    return out.transpose(1, 2)


def host_calls(
    target: HostTarget, device: str
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(ours, SDPA's equivalent call). Decode: q [B, Hq, 1, D] against the cache, SDPA without a
    mask (one query at the end of the cache sees every key). Varlen: a small packed batch
    (causal), SDPA on the same sequences right-padded with a boolean mask (causal and padding)."""
    api = ops()
    seed = case_seed(target.id)
    if target.call == "varlen":
        lengths = HOST_VARLEN_LENGTHS
        total, width = sum(lengths), max(lengths)
        q = _randn((total, target.heads_q, target.head_dim), target.dtype, device, seed)
        k = _randn((total, target.heads_kv, target.head_dim), target.dtype, device, seed + 1)
        v = _randn((total, target.heads_kv, target.head_dim), target.dtype, device, seed + 2)
        cu = cumulative(lengths, device)
        sizes = torch.tensor(lengths, device=device)
        index = torch.arange(width, device=device)
        key_valid = index[None, :] < sizes[:, None]  # [B, Sk]
        causal = index[None, :] <= index[:, None]  # [Sq, Sk]: Sq == Sk per sequence
        mask = (causal[None] & key_valid[:, None, :])[:, None]  # [B, 1, Sq, Sk]
        sdpa = _sdpa_gqa(
            padded_batch(q, lengths, width),
            padded_batch(k, lengths, width),
            padded_batch(v, lengths, width),
            attn_mask=mask,
        )
        return (
            lambda: api.flash_attention_varlen_forward(q, k, v, cu, cu, width, width, True)
        ), sdpa
    case = Case(
        "decode",
        target.dtype,
        target.batch,
        target.heads_q,
        target.heads_kv,
        1,
        target.seqlen_k,
        target.head_dim,
        True,
    )
    x = make_inputs(case, device)
    sdpa = _sdpa_gqa(x.q, x.k, x.v)
    if target.call == "decode":
        return (lambda: api.flash_attention_decode(x.q, x.k, x.v)), sdpa
    lengths = torch.full((target.batch,), target.seqlen_k, dtype=torch.int32, device=device)
    if target.call == "decode-lens":
        return (lambda: api.flash_attention_decode(x.q, x.k, x.v, lengths)), sdpa
    return paged_decode_call(x, 64, seed, lengths), sdpa


def host_costs(fns: dict[str, Callable[[], object]], calls: int) -> list[HostCost | NotMeasured]:
    """The host cost of each of fns: HOST_LOOPS loops of `calls` calls each, the sides' loops in
    turn (measure.in_turn), so a drift of the host's speed hits every side alike; each side's
    median loop, in the order of fns. A side that refuses or fails is a record."""
    done: dict[str, HostCost | NotMeasured] = {}
    for name, fn in fns.items():
        refused = measure.first_call_record(fn)
        if refused is not None:
            done[name] = refused
    loops: dict[str, list[float]] = {name: [] for name in fns if name not in done}
    for index in range(HOST_LOOPS):
        for name in measure.in_turn([name for name in loops if name not in done], index):
            try:
                loops[name] += host_cost_us(fns[name], calls, 1)
            except RuntimeError as exc:
                done[name] = NotMeasured("error", first_line(exc))
    for name, times in loops.items():
        if name not in done:
            done[name] = HostCost(
                sig(statistics.median(times), 4), calls, [sig(t, 4) for t in times]
            )
    return [done[name] for name in fns]


def run_host(target: HostTarget, device: str) -> HostRecord:
    if device != "cuda":
        ours = sdpa = NotMeasured("unsupported", CUDA_ONLY_HOST)
    else:
        try:
            fn, sdpa_fn = host_calls(target, device)
        except Exception as exc:  # out of memory, or an argument our op rejects: a record
            ours = sdpa = NotMeasured("error", f"building the inputs: {first_line(exc)}")
        else:
            ours, sdpa = host_costs({"ours": fn, "sdpa": sdpa_fn}, target.calls)
    ratio = None
    if isinstance(ours, HostCost) and isinstance(sdpa, HostCost) and ours.us_per_call:
        ratio = sig(sdpa.us_per_call / ours.us_per_call, 4)
    return _record(
        HostRecord,
        target,
        ours=ours,
        sdpa=sdpa,
        ratio=ratio,
    )


# --------------------------------------------------------------------------------------------------
# The small model
# --------------------------------------------------------------------------------------------------


def _wall_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def model_timing(
    model, target: ModelTarget, ids: torch.Tensor, device: str, timer, config: TimingConfig
) -> ModelTiming:
    """Prefill: one forward of the batch, timed as the cases are. Decode: greedy generation of
    new_tokens and of 1 token (wall clock around each, median of MODEL_RUNS after one untimed);
    the tokens after the first over the time they add."""
    mask = torch.ones_like(ids)

    def prefill():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits

    def generate(tokens: int):
        def run():
            with torch.no_grad():
                return model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=False,
                    pad_token_id=0,
                )

        run()
        return statistics.median(_wall_ms(run, device) for _ in range(MODEL_RUNS))

    prefill_ms = benchmark(prefill, timer, config).median_ms
    full_ms, first_ms = generate(target.new_tokens), generate(1)
    decode_s = max(full_ms - first_ms, 1e-6) / 1e3
    return ModelTiming(
        prefill_ms=sig(prefill_ms),
        generate_ms=sig(full_ms),
        decode_tokens_per_s=sig(target.batch * (target.new_tokens - 1) / decode_s, 4),
    )


def run_model(target: ModelTarget, device: str, timer, config: TimingConfig) -> ModelRecord:
    ours: ModelTiming | NotMeasured
    sdpa: ModelTiming | NotMeasured
    if device != "cuda":
        ours = sdpa = NotMeasured("unsupported", CUDA_ONLY_MODEL)
    else:
        ours, sdpa = _time_models(target, device, timer, config)
    prefill_ratio = decode_ratio = None
    if isinstance(ours, ModelTiming) and isinstance(sdpa, ModelTiming):
        prefill_ratio = sig(sdpa.prefill_ms / ours.prefill_ms, 4) if ours.prefill_ms else None
        if sdpa.decode_tokens_per_s:
            decode_ratio = sig(ours.decode_tokens_per_s / sdpa.decode_tokens_per_s, 4)
    return _record(
        ModelRecord,
        target,
        ours=ours,
        sdpa=sdpa,
        prefill_ratio=prefill_ratio,
        decode_ratio=decode_ratio,
    )


def _time_models(target: ModelTarget, device: str, timer, config):
    from ...integrations.transformers import register
    from . import smallmodel

    try:
        name = register()
        reference = smallmodel.llama_model("sdpa", None, DTYPES[target.dtype], device)
    except ImportError as exc:
        missing = NotMeasured("unsupported", str(exc))
        return missing, missing
    generator = torch.Generator().manual_seed(case_seed(target.id))
    vocab = reference.config.vocab_size
    ids = torch.randint(1, vocab, (target.batch, target.prompt), generator=generator).to(device)
    results = []
    for implementation in (name, "sdpa"):
        try:
            model = smallmodel.llama_model(
                implementation, reference.state_dict(), DTYPES[target.dtype], device
            )
            results.append(model_timing(model, target, ids, device, timer, config))
            del model
        except Exception as exc:  # a failure of either side is a record, not a crash
            results.append(NotMeasured("error", first_line(exc)))
    del reference
    torch.cuda.empty_cache()
    return results[0], results[1]


# --------------------------------------------------------------------------------------------------
# The training step
# --------------------------------------------------------------------------------------------------

STEP_LR = 1e-4  # small enough that the weights stay sane over the hundreds of timed steps


def training_step(model, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One optimizer step of `model` on `ids`, a causal-LM loss on the tokens themselves:
    gradients cleared, forward, backward, AdamW. Each call returns its loss, detached."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=STEP_LR)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def step_models(target: StepTarget, device: str) -> tuple:
    """(our model, SDPA's model, the tokens): the target's model on our attention and on SDPA's,
    the first loading the second's weights (one initialisation), and random tokens from the
    target's seed. ImportError (with the install hint) without transformers."""
    from ...integrations.transformers import register
    from . import smallmodel

    name = register()
    config = smallmodel.training_config(
        target.layers, target.heads_q, target.heads_kv, target.head_dim, target.seqlen, target.vocab
    )
    dtype = DTYPES[target.dtype]
    sdpa = smallmodel.training_model(config, "sdpa", None, dtype, device)
    ours = smallmodel.training_model(config, name, sdpa.state_dict(), dtype, device)
    generator = torch.Generator().manual_seed(case_seed(target.id))
    ids = torch.randint(1, target.vocab, (target.batch, target.seqlen), generator=generator)
    return ours, sdpa, ids.to(device)


def _tokens_per_s(target: StepTarget, result) -> float | None:
    if isinstance(result, Measured) and result.median_ms:
        return sig(target.tokens / (result.median_ms * 1e-3), 4)
    return None


def run_step(target: StepTarget, device: str, timer, config, ceilings, say=None) -> StepRecord:
    """Our model's training step and SDPA's model's, timed in the same interleaved rounds."""
    try:
        ours_model, sdpa_model, ids = step_models(target, device)
    except ImportError as exc:  # no transformers: the install hint
        ours = sdpa = NotMeasured("unsupported", str(exc))
    except Exception as exc:  # out of memory, a config transformers rejects: a record
        ours = sdpa = NotMeasured("error", f"building the models: {first_line(exc)}")
    else:
        calls = {
            "ours": training_step(ours_model, ids),
            "sdpa": training_step(sdpa_model, ids),
        }
        ours, sdpa = _side_by_side(calls, target, device, timer, config, ceilings, say).values()
        del calls, ours_model, sdpa_model
    return _record(
        StepRecord,
        target,
        ours=_without_samples(ours),
        sdpa=_without_samples(sdpa),
        ours_tokens_per_s=_tokens_per_s(target, ours),
        sdpa_tokens_per_s=_tokens_per_s(target, sdpa),
        ratio=_time_ratio(sdpa, ours),
    )


# --------------------------------------------------------------------------------------------------
# The training run of the loss target
# --------------------------------------------------------------------------------------------------

LOSS_LR = 1e-3  # AdamW's: the Markov chain's loss falls all the way through the run, smoothly
MODEL_DTYPES = {"fp32": torch.float32, **DTYPES}


def loss_models(target: LossTarget, device: str) -> tuple:
    """(our model, eager's model, the batches [steps, batch, seqlen]): the target's Gemma-2-style
    model on our attention and on transformers' eager one, the first loading the second's
    weights, and the Markov chain's tokens from the target's seed. ImportError (with the install
    hint) without transformers."""
    from ...integrations.transformers import register
    from . import smallmodel

    name = register()
    config = smallmodel.gemma2_config(
        target.layers,
        target.heads_q,
        target.heads_kv,
        target.head_dim,
        target.seqlen,
        target.window,
        target.softcap,
        target.vocab,
    )
    dtype = MODEL_DTYPES[target.dtype]
    eager = smallmodel.gemma2_model(config, "eager", None, dtype, device)
    ours = smallmodel.gemma2_model(config, name, eager.state_dict(), dtype, device)
    tokens = smallmodel.markov_batches(
        target.steps, target.batch, target.seqlen, target.vocab, case_seed(target.id)
    )
    return ours, eager, tokens.to(device)


def train_losses(model, tokens: torch.Tensor) -> LossRun | NotMeasured:
    """AdamW on each batch of `tokens` in turn (a causal-LM loss on the tokens themselves): the
    loss of every step, or an error record where the loss stops being finite."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LOSS_LR)
    start = time.perf_counter()
    losses = []
    for ids in tokens:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    values = [float(loss) for loss in losses]  # one synchronisation, at the end
    seconds = time.perf_counter() - start
    bad = next((i for i, value in enumerate(values) if not math.isfinite(value)), None)
    if bad is not None:
        return NotMeasured("error", f"the loss is {values[bad]} at step {bad + 1}")
    return LossRun(sig(values[-1], 6), [sig(value, 6) for value in values], sig(seconds, 3))


def run_loss(target: LossTarget, device: str) -> LossRecord:
    """Both models trained on the same batches: eager's always, ours where our kernels take the
    model's window and softcap (else its record says why)."""
    ours: LossRun | NotMeasured
    eager: LossRun | NotMeasured
    try:
        ours_model, eager_model, tokens = loss_models(target, device)
    except ImportError as exc:  # no transformers: the install hint
        ours = eager = NotMeasured("unsupported", str(exc))
    except Exception as exc:  # out of memory, a config transformers rejects: a record
        ours = eager = NotMeasured("error", f"building the models: {first_line(exc)}")
    else:
        runs = []
        for model in (ours_model, eager_model):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # fp32 weights: ours computes in bf16
                    runs.append(train_losses(model, tokens))
            except Exception as exc:  # a failure of either side is a record, not a crash
                runs.append(NotMeasured("error", first_line(exc)))
        ours, eager = runs
        del ours_model, eager_model
    ratio = None
    if isinstance(ours, LossRun) and isinstance(eager, LossRun) and eager.final_loss:
        ratio = sig(ours.final_loss / eager.final_loss, 6)
    return _record(LossRecord, target, ours=ours, eager=eager, ratio=ratio)


# --------------------------------------------------------------------------------------------------


def _without_samples(result):
    if isinstance(result, Measured):
        result.samples_ms = None  # raw samples are kept for the matrix's cases only (history)
    return result


def _time_ratio(theirs, ours) -> float | None:
    """Their time over ours: our speed relative to theirs."""
    if isinstance(theirs, Measured) and isinstance(ours, Measured) and ours.median_ms:
        return sig(theirs.median_ms / ours.median_ms, 4)
    return None


def run_target(
    target, device: str, timer, config: TimingConfig, ceilings: dict, say=None
) -> TargetRecord:
    """One target case measured into its record; `say` hears of each retake of a disturbed one."""
    if isinstance(target, VarlenTarget):
        return run_varlen(target, device, timer, config, ceilings, say)
    if isinstance(target, PagedTarget):
        return run_paged(target, device, timer, config, ceilings, say)
    if isinstance(target, HostTarget):
        return run_host(target, device)
    if isinstance(target, StepTarget):
        return run_step(target, device, timer, config, ceilings, say)
    if isinstance(target, LossTarget):
        return run_loss(target, device)
    return run_model(target, device, timer, config)
