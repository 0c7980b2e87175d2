"""accumulate.py's step around the model, as the ledger walks it: the forward under a recompute
policy, the loss times its weight (and the loss scale), backward, the FP32 sums, the optimizer step.

Read memory_ledger.py first (the model's description), then ledger/walk.py (the engine).
The step is accumulation_step with one micro-batch (K = 1), as ledger/measure.py runs it:
micro-step 1, where native FP8 quantizes each weight and keeps the E4M3 copy until just
before AdamW. walk_step(micro_steps=2) walks a later micro-step too: micro-steps 2..K start
with the earlier ones' .grad alive (unless FP32 sums took them), AccumulateGrad adds into it
in place, and the FP8 copies are kept already.

Under each recompute policy (checkpoint.py), as the Plan of its units:
  no unit    every block's saved tensors are alive when backward starts; each block frees
             its own as backward passes through it.
  submodule units (the selective policy's attention core) their saved tensors come back for
             the length of their own backward: the output node (checkpoint.RerunNode) re-runs
             the unit up to the last tensor it saves (the core: att @ v's inputs); its inputs
             (the core's q, k and v) go once that is done.
  block units only the unit inputs are alive; backward re-runs a unit's forward up to the
             last tensor it saves (every block of the unit saves everything again), and
             each node of the unit lets go of its own as backward passes through it.
"""
from dataclasses import dataclass, replace

from ledger.ops import Ops
from ledger.walk import Graph, Walk


@dataclass(frozen=True)
class Description:
    """The model, described: memory_ledger's embeddings(g), block(g, x) and head(g, x) -> loss."""
    embeddings: object
    block: object
    head: object


@dataclass(frozen=True)
class Plan:
    """Which units a recompute policy runs through checkpoint.recompute (Policy.block_units,
    Policy.own_submodules of checkpoint.py): runs of consecutive blocks, and (block, submodule path)
    pairs recomputed as units of their own (the selective policy's: (i, "attn.core"))."""
    n_layer: int
    units: list
    submodule_units: frozenset


def forward(g, model, plan):
    """GPT.forward under `plan`: the embeddings, the blocks (GPT.block_runner: a block as it is,
    or a unit of blocks through checkpoint.recompute), the head. Returns the loss."""
    g.plan = plan
    with g.within("", "embedding"):
        x = model.embeddings(g)
    starts = {unit[0]: unit for unit in plan.units}
    i = 0
    while i < plan.n_layer:
        unit = starts.get(i)
        if unit is None:
            with g.within(f"{i}.", i):
                x = model.block(g, x)
            i += 1
        else:
            x = g.unit(f"unit {plan.units.index(unit)}", _blocks(g, model.block, unit), x, term="unit input",
                       scope="units")
            i = unit[-1] + 1
    with g.within("", "head"):
        return model.head(g, x)


def _blocks(g, block, unit):
    """run_blocks_in_order over one unit's blocks."""
    def run(x):
        for i in unit:
            with g.within(f"{i}.", i):
                x = block(g, x)
        return x
    return run


def walk_step(model, sizes, plan, static, temporaries, master_grads, fp32_sums, shard=1, optimizer=None,
              micro_steps=1):
    """Walk one steady-state micro-step and its optimizer step; returns the Walk (peak, where, parts).

    static: bytes alive throughout (states, buffers, the batch). temporaries: [(what, bytes)] the
    optimizer's step holds for a moment, one after another (the spec's step_temporaries: foreach AdamW's
    sqrt(v) per group). master_grads: bytes of the
    FP32 copies of the 16-bit gradients the optimizer step makes (4 per parameter; 0 for fp32).
    fp32_sums: with FP32 accumulation buffers those copies are made right after backward
    instead, added into the buffers and freed with the 16-bit .grad (accumulation_step).
    shard: ZeRO-3 over that many ranks (every parameter gradient / shard). optimizer:
    callable(g) walking the optimizer step instead of one rank's MasterWeightOptimizer (ledger/shard.py
    gives DDP's and ZeRO's; ledger/plan.py stops there to walk each rank's on its own, `tail`).
    micro_steps: 2 walks a later micro-step too, which starts with .grad and the kept FP8 copies
    alive (K > 2 repeats it: the same bytes)."""
    walk = Walk(static, shard)
    g = Ops(walk, sizes)
    loss = running = None
    for i in range(micro_steps):
        walk.tag = f"micro-step {i + 1}: " if i else ""
        g.accumulating = i > 0 and not fp32_sums  # .grad holds the earlier micro-steps' (FP32 sums took them)
        loss = forward(g, model, plan)  # the previous micro-step's loss goes as this one is assigned
        # parts.scaler.backward(loss * weights[i]): the loss times its weight, times the scale
        weighted = g.scalar("loss x weight", loss)
        scaled = g.scalar("loss x scale", weighted) if sizes.loss_scaled else weighted
        g.mark("end of forward")
        seed = g.new("backward: the loss gradient", "seed", 4)  # backward()'s ones_like(loss), held till it returns
        g.backward([(scaled, seed)])
        del seed, scaled, weighted
        g.mark("backward done")
        if fp32_sums:  # accumulation_step adds the 16-bit gradients into the FP32 buffers first
            as_fp32 = g.new("FP32 sums: every .grad as FP32", "grads as fp32", master_grads // shard)
            g.grads.clear()
            del as_fp32
        running = g.new("the step's running mean loss", "running loss", 4)  # accumulate.py's total_loss
    walk.tag = ""
    if optimizer is None:
        optimizer_step(g, temporaries, master_grads, fp32_sums, shard)
    else:
        optimizer(g)
    del loss, running
    g.mark("optimizer step done")
    return walk


def optimizer_step(g, temporaries, master_grads, fp32_sums, shard):
    """accumulate.optimizer_step: the kept FP8 weights released (the weights are about to change),
    then precision.MasterWeightOptimizer.step: FP32 copies of the gradients (16-bit precisions),
    then the optimizer's foreach step with its temporaries; then zero_grad frees every gradient
    (and the step's last reference to the loss goes with it)."""
    if g.kept:
        g.mark("FP8 weight copies released")
        g.kept.clear()
    master = None
    if master_grads and not fp32_sums:  # the FP32 buffers are the optimizer's gradients: no copy at the step
        master = g.new("optimizer step: FP32 master gradients", "master grads", master_grads // shard)
    for what, nbytes in temporaries:
        temporary = g.new(f"optimizer step: {what}", what, nbytes // shard)
        del temporary
    g.grads.clear()
    del master


# ---------------------------------------------------------------- the walk to the optimizer step, then each rank's

@dataclass(frozen=True)
class Before:
    """A step walked up to its optimizer step with nothing static: the same on every rank of DDP,
    ZeRO-1 and ZeRO-2 (they differ in what they hold throughout and in the optimizer step).
    totals, steps: its points; alive: the bytes alive as the optimizer step starts, of which
    grads the parameter gradients and kept the kept FP8 weight copies; peak_count: the storages
    alive at its highest point; first: how many of the points are the first micro-step's."""
    totals: tuple
    steps: tuple
    alive: int
    grads: int
    kept: int
    peak_count: int
    first: int

    def first_micro_step(self):
        """The walk of one micro-step (K = 1) read off a walk of two: the same first micro-step, and the
        same bytes alive after it (.grad, the kept copies, one loss, the running mean)."""
        return replace(self, totals=self.totals[:self.first], steps=self.steps[:self.first])


def walk_before(walk_it):
    """walk_it(optimizer) -> the Walk of walk_step(static=0, optimizer=...): stopped where the
    optimizer step would begin, what is alive there read off the walk."""
    seen = {}

    def stop(g):
        kept = {id(t.storage.entry): t.nbytes for copy in g.kept.values() for t in copy.values()}
        seen.update(points=len(g.walk.totals), alive=g.walk.total, kept=sum(kept.values()),
                    grads=sum(t.storage.entry.nbytes for t in g.grads.values()))
    Walk.track_parts = False  # nothing here reads what is alive at the peak
    try:
        w = walk_it(stop)
    finally:
        Walk.track_parts = True
    n = seen["points"]
    first = next((i for i, where in enumerate(w.steps) if where.startswith("micro-step 2: ")), n)
    return Before(tuple(w.totals[:n]), tuple(w.steps[:n]), seen["alive"], seen["grads"], seen["kept"], w.peak_count,
                  first)


def tail(before, static, optimizer):
    """The optimizer step walked on its own: what `before` left alive, `static` bytes throughout,
    then optimizer(g). With before's points (+ static) ahead of its own, the points of walk_step
    with that static and optimizer (tests/test_plan.py holds them equal)."""
    g = Graph(Walk(static + before.alive - before.grads - before.kept), None)
    if before.grads:  # every .grad as one: the optimizer steps free them all at once
        g.grads[".grad"] = g.new("the optimizer step begins: .grad", ".grad", before.grads)
        g.grads[".grad"].storage.entry.grad = True
    if before.kept:
        kept = g.new("the optimizer step begins: the kept FP8 weights", "kept", before.kept)
        g.kept["FP8 weights"] = {"copies": kept}
        del kept  # the optimizer step's release must free it
    optimizer(g)
    return g.walk
