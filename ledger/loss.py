"""The loss alone at its most: model.GPT.head_and_loss run by itself, on fake tensors or real ones.

Chapter section 4 ("the loss in pieces"). Read `loss_at_most` first: memory_ledger.loss_temporaries_closed
states the formula it checks, `make ledger` prints both beside the measured bytes, `make plan` asks it
whether a whole loss less its own bytes would fit. docs/loss.md has the why.
"""
import contextlib
import dataclasses

import torch

import model
import precision
from ledger import measure
from ledger.cuda_rules import cuda_dtypes, cuda_rules, emulated
from ledger.trace import fake_tensors, traced_device


class _Described(measure.LiveTensors):
    """LiveTensors that also tells what was alive at its peak: [(dtype, shape, bytes)] of each storage."""

    def __init__(self, device, outputs=None):
        super().__init__(device, outputs=outputs)
        self.told, self.at_peak = {}, {}

    def _add(self, t):
        self._drop_dead()  # a dead storage's id may be this one's now
        if isinstance(t, torch.Tensor) and t.device.type == self.device.type:
            if measure.storage_key(t) not in self.live:
                self.told[measure.storage_key(t)] = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        super()._add(t)

    def _counted(self, op=None, grew=False):
        if self.now > self.peak:
            self.at_peak = {key: (*self.told.get(key, ("?", ())), n) for key, n in self.live.items()}
        super()._counted(op, grew)


def loss_at_most(cfg, fake=True, device=None):
    """(bytes, [(dtype, shape, bytes)] alive then) of model.GPT.head_and_loss at its most beyond its inputs,
    run alone on `device` (None: where cfg's step is traced), fake or real: memory_ledger.loss_temporaries_closed."""
    prec = precision.decide(cfg)
    device = torch.device(device or traced_device(cfg))
    with fake_tensors() if fake else contextlib.nullcontext(), cuda_rules(fake and emulated(cfg)), device:
        # one block is built, none runs: the head and the loss alone
        gpt = model.GPT(dataclasses.replace(cfg, n_layer=1), prec.linear_factory()).to(prec.param_dtype)
        x = torch.randn(cfg.batch_size, cfg.block_size, cfg.n_embd, dtype=prec.param_dtype, requires_grad=True)
        targets = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size))
        tracker = _Described(device, cuda_dtypes if fake and emulated(cfg) else None)
        inputs = [x, targets, *gpt.parameters(), *gpt.buffers()]
        with tracker:
            tracker.adopt(inputs)
            tracker.reset_peak()
            before = tracker.read()
            gpt.head_and_loss(x, targets)[1].backward()
            del x.grad
    kept = {measure.storage_key(t) for t in inputs}
    return tracker.peak - before, [told for key, told in tracker.at_peak.items() if key not in kept]
