"""Exceptions jdllm raises on bad input. Each message names the value and the fix."""

import os
import sys
import warnings


class JdllmError(Exception):
    """Base class of every error jdllm raises on purpose."""


class ConfigError(JdllmError, ValueError):
    """A config.json jdllm cannot use (unknown model_type, missing key, bad value)."""


class UnknownArchitectureError(ConfigError):
    """config.json names a model_type / architecture jdllm does not implement."""


class QuantizationError(ConfigError):
    """A `quantize=` request jdllm cannot honour: an unknown scheme, weights already quantized,
    a quantized checkpoint whose scheme or shapes disagree with what was asked."""


class CheckpointError(JdllmError):
    """A weights directory that is incomplete, corrupt or disagrees with its config."""


class MissingShardError(CheckpointError):
    """A shard listed in model.safetensors.index.json is not on disk."""


class MissingTensorError(CheckpointError):
    """A tensor the config requires is absent from the checkpoint."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds a tensor jdllm does not know where to put."""


class ShapeMismatchError(CheckpointError):
    """A tensor's shape disagrees with the shape the config implies."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors / Orbax file that cannot be read."""


class OutputExistsError(JdllmError, FileExistsError):
    """The conversion target already exists and --overwrite was not given."""


class InputError(JdllmError, ValueError):
    """Bad input to generate() / logits(): token ids, lengths, prompts."""


class TokenOutOfRangeError(InputError):
    """A token id outside [0, vocab_size)."""


class SequenceTooLongError(InputError):
    """Prompt (+ generation) longer than the model's context."""


class DecodingConfigError(JdllmError, ValueError):
    """A paradigm or sampling setting outside its accepted range."""


class ArgumentTypeError(JdllmError, TypeError):
    """An argument of the wrong type (a dict where a Sampling goes, a string where a number goes)."""


class ConstraintError(JdllmError, ValueError):
    """A constraint that cannot be used: bad pattern / schema / grammar, an empty language,
    a backend that cannot compile it, or a model without a tokenizer."""


class NonFiniteWeightsError(CheckpointError):
    """A weight tensor holds NaN or infinity (`load(..., check_finite=True)`)."""


class OutputPathError(JdllmError, OSError):
    """An output path that cannot be written (missing or read-only directory, a file in the way)."""


class CacheDirError(OutputPathError):
    """`JDLLM_CACHE_DIR` names a path jdllm cannot use as its compilation cache (a file in the way)."""


class DeviceMemoryError(JdllmError, MemoryError):
    """The model's parameters do not fit in a device's free memory (raised before any weight is placed)."""


class ShardingError(JdllmError, ValueError):
    """A mesh or rules table jdllm cannot use: an unknown logical or mesh axis, a mesh axis that
    does not divide the dimension it splits (the message names the parameter and the axis)."""


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning issued here point at the first caller outside jdllm."""

    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` attributed to the user's code that called into jdllm, not to jdllm itself."""

    warnings.warn(message, category, stacklevel=user_stacklevel())


class QueueFullError(JdllmError):
    """The serving engine's bounded queue is full (the server answers 429): retry later."""


class EngineStoppedError(JdllmError):
    """The serving engine is shutting down and accepts no new requests (the server answers 503)."""
