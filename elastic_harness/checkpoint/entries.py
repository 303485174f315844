"""The names of what a checkpoint holds: the one place they are spelled.

``runtime.state.build_state`` builds a state with these keys; the compatibility check,
the offline readers (``ckpt export``/``diff``/``verify``) and ``ckpt import`` read them.
"""

MODEL = "model"  # parameters and persistent buffers, world-size-free names
OPTIM = "optim"  # optimizer state and param groups
TRAIN = "train"  # step, data cursor, seed, dataset size, saved world size
SCHED = "sched"  # the LR scheduler's own state_dict()
SCALER = "scaler"  # the GradScaler's own state_dict() (fp16)
EXTRA_PREFIX = "extra."  # anything else a script registers: extra.NAME

# Compared key by key and shape by shape before a load: a model's tensors and the
# optimizer's per-parameter state must match exactly (DCP ignores extra keys itself).
STRICT_PREFIXES = (MODEL + ".", OPTIM + ".state.")


def top_level(flat_key: str) -> str:
    """``model.layer.weight`` -> ``model``; ``extra.ema.w`` -> ``extra.ema``."""
    if flat_key.startswith(EXTRA_PREFIX):
        rest = flat_key[len(EXTRA_PREFIX):]
        return EXTRA_PREFIX + rest.split(".", 1)[0]
    return flat_key.split(".", 1)[0]
