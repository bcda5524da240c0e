"""
experiments/layers.py: a change to the CPU's 16-bit trainer, layered over its mode as it stands.

precision.TensorCoreMatmuls is the 16-bit trainer's mode on a CPU; logits_fn reads the name at
each call, so a subclass put in its place changes every trainer built after. Each experiment
that changes one op of the trainer (embed32.py's embedding backward, fused.py's attention)
adds a layer: its handler sees each call of the strict (16-bit trainer's) forward first and
returns a result, or None to leave the call to the layer below. Layers stack in the order they
are added (sites.install, which replaces the mode outright, goes first); remove() takes the top
one off. The warm start's mode (not strict) and float32 never reach a handler.
"""
import common  # first: it puts the core (precision.py) on the path
import precision

def add(handler):
    """Put handler(mode, func, args, kwargs) on the trainer's mode as it stands."""
    base = precision.TensorCoreMatmuls

    class Layer(base):
        below = base  # what remove puts back

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = handler(self, func, args, kwargs) if self.strict else None
            return super().__torch_function__(func, types, args, kwargs) if out is None else out

    precision.TensorCoreMatmuls = Layer  # logits_fn reads the name at each call
    return Layer

def remove():
    """The trainer's mode as it was before the top layer (tests: both trainers in a process)."""
    top = precision.TensorCoreMatmuls
    precision.TensorCoreMatmuls = getattr(top, "below", top)
