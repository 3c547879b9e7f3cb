"""The load profiles, and a workload's ``[load]`` section read into one.

Adding a profile = one module in this package with a :class:`~.profile.LoadProfile` subclass (its settings,
points and run), and one import here (no second list to keep: :data:`PROFILES` is what the imports registered). Workload files and load points then know its name.

The flat form: workload files from before ``[load]`` give the load as top-level keys (``load_profile``,
``concurrency``, ``request_rates``, ...), and run.json records every workload that way. Each profile reads
the flat keys that name it (:meth:`~.profile.LoadProfile.from_flat`) and writes them back
(:meth:`~.profile.LoadProfile.flat`); :data:`FLAT_DEFAULTS` fills the keys a profile does not take.
"""
from __future__ import annotations

# A profile class registers its name when it is defined (profile.py): importing its module here is what adds it.
from .concurrent import Concurrent
from .constant import Constant  # noqa: F401
from .poisson import Poisson  # noqa: F401
from .profile import LoadProfile, profile_class, registered
from .sweep import Sweep  # noqa: F401

PROFILES: dict[str, type[LoadProfile]] = registered()
DEFAULT = Concurrent  # a workload that names no profile

# the flat form's load keys, in the order run.json records them, with the values that meant "not given"
FLAT_DEFAULTS = {"load_profile": DEFAULT.name, "concurrency": [], "request_rates": [], "saturation_steps": 4,
                 "requests": None, "rounds": 1, "duration_s": None}


def read_section(section: dict) -> LoadProfile:
    """A ``[load]`` section (``profile`` picks the class; the rest is that profile's settings) as its profile."""
    section = dict(section)
    cls = profile_class(section.pop("profile", DEFAULT.name), "profile")
    return cls.model_validate(section)


def section_from_flat(flat: dict) -> dict:
    """The ``[load]`` section that a flat workload's load keys mean (a ValueError when they mean none)."""
    given = {k: v for k, v in flat.items() if not _is_default(v, FLAT_DEFAULTS[k])}
    given["load_profile"] = flat.get("load_profile", DEFAULT.name)
    profile_class(given["load_profile"], "load_profile")  # an unknown name says which are known
    # a profile that yields others' points (a sweep) is asked first: its flat keys also name its arrivals
    for cls in sorted(registered().values(), key=lambda c: not c.yields_others):
        section = cls.from_flat(given)
        if section is not None:
            return section
    raise ValueError(f"load_profile {given['load_profile']!r}: no load profile reads these keys "
                     f"({', '.join(sorted(given))})")


def flat(profile: LoadProfile) -> dict:
    """``profile`` as a flat workload's load keys, every key present (run.json's record)."""
    own = profile.flat()
    return {k: own.get(k, default) for k, default in FLAT_DEFAULTS.items()}


def _is_default(value, default) -> bool:
    # true is not 1: a flag where a number belongs is refused by the profile, not taken for the default
    return type(value) is type(default) and value == default
