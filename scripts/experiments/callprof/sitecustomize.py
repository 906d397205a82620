"""Where each rank's main-thread CPU goes per training step (issue 27 item 8): put this directory on PYTHONPATH.

Wraps torch.optim.AdamW.step (both 050fcbc and HEAD step one AdamW per rank) and measures the main thread from the
end of optimizer step NT_PROF_FROM to the end of step NT_PROF_TO (default 20..40); each rank writes a file to
NT_PROF_DIR:
  NT_PROF_MODE=calls (default): cProfile with a thread-CPU timer -> rank{R}.prof (pstats; compare.py reads them);
  NT_PROF_MODE=cpu: no profiler -> rank{R}.json: the thread's CPU per step, the CPU spent in the garbage collector
  per step (gc.callbacks) and its collections per generation, and the objects the collector tracks.
  NT_PROF_MODE=callgrind: the ranks in NT_PROF_RANKS (default "0") re-execute themselves under valgrind's callgrind
  with instrumentation off, switched on for the window only (NT_CGCTL: a shared library built from cgctl.c) ->
  callgrind.rank{R}.1: instructions executed per function over the window, whatever the machine's load
  (cg_objects.py sums them per shared object). Build NT_CGCTL with `gcc -O2 -shared -fPIC -o libcgctl.so cgctl.c`.
"""
import os

if os.environ.get("NT_PROF_DIR") and os.environ.get("NT_PROF_MODE") == "callgrind" \
        and os.environ.get("RANK") in os.environ.get("NT_PROF_RANKS", "0").split(",") \
        and not os.environ.get("NT_PROF_INSIDE"):
    os.environ["NT_PROF_INSIDE"] = "1"
    _argv = open("/proc/self/cmdline", "rb").read().rstrip(b"\0").split(b"\0")
    os.makedirs(os.environ["NT_PROF_DIR"], exist_ok=True)
    os.execvp("valgrind", ["valgrind", "--tool=callgrind", "--instr-atstart=no", "-q",
                           f"--callgrind-out-file={os.environ['NT_PROF_DIR']}/callgrind.rank{os.environ['RANK']}",
                           *[a.decode() for a in _argv]])

if os.environ.get("NT_PROF_DIR"):
    import cProfile
    import gc
    import json
    import time

    import torch

    _lo, _hi = int(os.environ.get("NT_PROF_FROM", 20)), int(os.environ.get("NT_PROF_TO", 40))
    _mode = os.environ.get("NT_PROF_MODE", "calls")
    _step = torch.optim.AdamW.step
    _state = {"n": 0, "prof": None, "gc_s": 0.0, "gc_n": [0, 0, 0], "on": False}

    def _on_gc(phase, info):
        if not _state["on"]:
            return
        if phase == "start":
            _state["t"] = time.thread_time()
        else:
            _state["gc_s"] += time.thread_time() - _state["t"]
            _state["gc_n"][info["generation"]] += 1

    def _wrapped(self, *a, **k):
        out = _step(self, *a, **k)
        _state["n"] += 1
        if _state["n"] == _lo:
            if _mode == "callgrind":
                if os.environ.get("NT_PROF_INSIDE"):
                    import ctypes
                    _state["cg"] = ctypes.CDLL(os.environ["NT_CGCTL"])
                    _state["cg"].cg_start()
            elif _mode == "calls":
                _state["prof"] = cProfile.Profile(time.thread_time)
                _state["prof"].enable()
            else:
                gc.callbacks.append(_on_gc)
                _state.update(on=True, t0=time.thread_time(), objects=len(gc.get_objects()))
        elif _state["n"] == _hi and "cg" in _state:
            _state["cg"].cg_stop()
        elif _state["n"] == _hi:
            rank = os.environ.get("RANK", "0")
            os.makedirs(os.environ["NT_PROF_DIR"], exist_ok=True)
            if _state["prof"] is not None:
                _state["prof"].disable()
                _state["prof"].dump_stats(os.path.join(os.environ["NT_PROF_DIR"], f"rank{rank}.prof"))
            elif _state["on"]:
                steps = _hi - _lo
                cpu, _state["on"] = time.thread_time() - _state["t0"], False
                with open(os.path.join(os.environ["NT_PROF_DIR"], f"rank{rank}.json"), "w") as f:
                    json.dump({"cpu_ms": cpu / steps * 1e3, "gc_ms": _state["gc_s"] / steps * 1e3,
                               "gc_collections": _state["gc_n"], "objects": _state["objects"]}, f)
        return out

    torch.optim.AdamW.step = _wrapped
