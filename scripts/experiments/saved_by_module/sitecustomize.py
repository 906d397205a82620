"""Issue 50 item 5: which module's tensors make a rank's saved-activation peak (docs/cp.md "Long context").
Put this directory first on PYTHONPATH and every rank (a subprocess inheriting it) loads it: each tensor the
memory meter (observe/memory.py SavedActivations) counts is tagged with the module whose forward saved it, and at
each step's peak the bytes by module are kept; at exit each rank writes $CPPROBE_DIR/rank{RANK}.json (per step:
the peak, bytes by module, the 25 largest tensors). Measurement only: never on PYTHONPATH for training.

    CPPROBE_DIR=/tmp/probe PYTHONPATH=scripts/experiments/saved_by_module:src \\
        python -m nanotitan.cli train <cp_long_context.py's train_args for --parallel.cp 4, 3 steps>
"""
import atexit, collections, json, os
import torch
from nanotitan.observe import memory as M

_names = {}
_stack = []
def _pre(mod, args):
    _stack.append(_names.get(id(mod), type(mod).__name__))
def _post(mod, args, out):
    if _stack: _stack.pop()
torch.nn.modules.module.register_module_forward_pre_hook(_pre)
torch.nn.modules.module.register_module_forward_hook(_post)

_init = M.SavedActivations.__init__
def __init__(self, model=None):
    _init(self, model)
    if model is not None:
        for n, m in model.named_modules():
            _names[id(m)] = n or "<root>"
    self.tag_of = {}; self.by_tag = collections.Counter(); self.at_peak = {}; self.shape_of = {}
M.SavedActivations.__init__ = __init__

_orig_st_init = M._SavedTensor.__init__
def _st_init(self, meter, t, key, nbytes):
    if key not in meter.live:
        tag = _stack[-1] if _stack else ("<bwd>" if not torch.is_grad_enabled() else "<none>")
        meter.tag_of[key] = tag; meter.shape_of[key] = (tuple(t.shape), str(t.dtype))
    _orig_st_init(self, meter, t, key, nbytes)
M._SavedTensor.__init__ = _st_init

_add = M.SavedActivations._add
def _addp(self, key, nbytes, sign):
    with self.lock:
        before = self.live.get(key, [0, 0])[1]
        _add(self, key, nbytes, sign)
        after = self.live.get(key, [0, 0])[1]
        tag = self.tag_of.get(key, "?")
        self.by_tag[tag] += after - before
        if key not in self.live:
            self.tag_of.pop(key, None); sh = self.shape_of.pop(key, None)
        if self.bytes >= self.peak_bytes and self.bytes > getattr(self, "_snap", 0) + (1 << 20):
            self._snap = self.bytes
            self.at_peak = {"bytes": self.bytes, "by_tag": dict(self.by_tag),
                            "big": sorted(((self.live[k][1], self.tag_of.get(k), self.shape_of.get(k)) for k in self.live), key=lambda x: -x[0])[:25]}
M.SavedActivations._add = _addp
_rp = M.SavedActivations.reset_peak
def _rpp(self):
    if getattr(self, "at_peak", None):
        self.steps_peaks = getattr(self, "steps_peaks", []) + [self.at_peak]
    self.at_peak = {}; self._snap = 0
    _rp(self)
M.SavedActivations.reset_peak = _rpp

_all = []
_i = __init__
def __init2__(self, model=None):
    _i(self, model); _all.append(self)
M.SavedActivations.__init__ = __init2__

@atexit.register
def _dump():
    d = os.environ.get("CPPROBE_DIR")
    if not d or not _all: return
    r = os.environ.get("RANK", "0")
    out = [{"peak": m.peak_bytes, "steps": getattr(m, "steps_peaks", []) + [m.at_peak]} for m in _all]
    with open(f"{d}/rank{r}.json", "w") as f: json.dump(out, f, default=str)
