"""A run option declared once (bench/run/option_fields.py): its flags, its value from them, run.json's record."""
from dataclasses import dataclass

import pytest
import typer
from typer.testing import CliRunner

from kvbench.run.option_fields import Flag, FlagError, declared, flags, option, read_flags, recorded
from kvbench.run.options import RunOptions


def positive(flags: dict, earlier: dict) -> int:
    if flags["count"] < 1:
        raise ValueError(f"--count takes 1 or more, not {flags['count']}")
    return flags["count"]


def mode(flags: dict, earlier: dict) -> str:
    if flags["fast"] and flags["slow"]:
        raise FlagError("--fast and --slow exclude each other", "--fast")
    return "fast" if flags["fast"] else "slow" if flags["slow"] else earlier["name"]


@dataclass(kw_only=True)
class Toy:
    name: str = option(Flag("name", str, "a", "A name."), record="name")
    count: int = option(Flag("count", int, 2, "How many."), read=positive, default=2, record="count_given",
                        recorded=lambda count, run: count * run)
    mode: str = option(Flag("fast", bool, False, "Fast.", names=("--fast",)),
                       Flag("slow", bool, False, "Slow.", names=("--slow",)),
                       read=lambda f, earlier: mode(f, earlier), default="a")
    argv: list[str] = option(record="argv", default_factory=list)  # set in code only
    hz: float = 10.0  # not an option


def test_an_option_field_gives_its_flags_value_and_record():
    assert [f.param for f in flags(Toy)] == ["name", "count", "fast", "slow"]
    toy = read_flags(Toy, {"name": "b", "count": 3, "fast": False, "slow": True}, hz=5.0)
    assert (toy.name, toy.count, toy.mode, toy.argv, toy.hz) == ("b", 3, "slow", [], 5.0)
    assert read_flags(Toy, {"name": "b", "count": 3, "fast": False, "slow": False}).mode == "b"  # reads earlier
    assert recorded(toy, 10) == {"name": "b", "count_given": 30, "argv": []}
    assert Toy() == Toy(name="a", count=2, mode="a", argv=[], hz=10.0)  # one flag read as it is: its default
    with pytest.raises(ValueError, match="--count takes 1 or more, not 0"):
        read_flags(Toy, {"name": "b", "count": 0, "fast": False, "slow": False})
    with pytest.raises(FlagError) as refused:
        read_flags(Toy, {"name": "b", "count": 1, "fast": True, "slow": True})
    assert refused.value.flag == "--fast"


def test_every_flag_of_kvbench_run_is_a_run_options_flag():
    from kvbench.commands.run import run

    sub = typer.Typer(add_completion=False, rich_markup_mode=None)
    sub.command("run")(run)
    params = typer.main.get_command(sub).params
    assert [p.name for p in params] == [f.param for f in flags(RunOptions)]
    backend = next(p for p in params if p.name == "backend")
    assert backend.opts == ["--backend", "-b"] and backend.metavar == "BACKEND" and backend.multiple
    help_text = CliRunner().invoke(sub, ["--help"], env={"COLUMNS": "200"}).output
    assert "--start-timeout" in help_text and "Seconds an engine may take to become ready." in help_text


def test_run_json_records_the_options_it_always_recorded():
    keys = {opt.record for _, opt in declared(RunOptions) if opt.record}
    assert keys == {"backends", "workload", "kv_dtype", "run_id", "repeats", "interleaved", "memory_limit_bytes",
                    "prompt_salt", "reset_cache_between_cells", "command",
                    "max_context_asked",  # --max-context as given, so that a resume is held to it
                    "load_share", "load_owner"}  # a share of a run on several machines (kvbench merge reads them)
