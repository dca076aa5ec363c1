"""Every KERNELGEN_* environment variable, read in this one place."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_DEBUG_LEVELS = range(0, 3)


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    always_compile: bool
    no_compile: bool
    dump_sources: bool
    debug: int
    autotune: bool
    backward: str  # KERNELGEN_BACKWARD: "auto" (by GPU) or "sm80" (the mma.sync main kernel)
    # KERNELGEN_RANGE_BACKWARD: "ranges" (a kv range that reads tensors runs its Hopper backward
    # on the ranges themselves) or "blockmask" (on a block mask built from them: PERF_NOTES §109,
    # not yet run on a GPU, so not the default)
    range_backward: str = "ranges"


def _flag(name: str) -> bool:
    text = os.environ.get(name, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingsError(f"{name}={os.environ[name]!r}: not a boolean; allowed: 1, 0, true, false")


def _debug_level() -> int:
    text = os.environ.get("KERNELGEN_DEBUG", "").strip() or "0"
    try:
        level = int(text)
    except ValueError:
        level = -1
    if level not in _DEBUG_LEVELS:
        raise SettingsError(f"KERNELGEN_DEBUG={text!r}: not a debug level; allowed: 0, 1, 2")
    return level


def _choice(name: str, allowed: tuple[str, ...], what: str) -> str:
    """The variable's value (lower case), allowed[0] where it is unset or empty."""
    text = os.environ.get(name, "").strip().lower() or allowed[0]
    if text not in allowed:
        raise SettingsError(f"{name}={os.environ[name]!r}: not {what}; allowed: "
                            f"{', '.join(allowed)}")
    return text


def _cache_dir() -> Path:
    explicit = os.environ.get("KERNELGEN_CACHE_DIR")
    if explicit:
        path = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg) if xdg else Path.home() / ".cache") / "kernelgen"
    # 0700: cached binaries are loaded and run, so other users must not be able to plant them.
    # An existing directory keeps the mode its owner gave it.
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@functools.cache
def settings() -> Settings:
    return Settings(
        cache_dir=_cache_dir(),
        always_compile=_flag("KERNELGEN_ALWAYS_COMPILE"),
        no_compile=_flag("KERNELGEN_NO_COMPILE"),
        dump_sources=_flag("KERNELGEN_DUMP_SOURCES"),
        debug=_debug_level(),
        autotune=_flag("KERNELGEN_AUTOTUNE"),
        backward=_choice("KERNELGEN_BACKWARD", ("auto", "sm80"), "a backward family"),
        range_backward=_choice("KERNELGEN_RANGE_BACKWARD", ("ranges", "blockmask"), "a choice"),
    )


def reload_settings() -> None:
    # Lazy: the next settings() call reads the environment (and creates the cache dir), so a test
    # restoring the real environment on teardown does not create the user's cache dir.
    settings.cache_clear()
