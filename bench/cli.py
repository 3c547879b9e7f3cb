"""The ``kvbench`` command. Each verb lives in its own module under bench/commands/."""
import typer

from kvbench.commands import compare, default_bench, plan, report, run, setup, validate

app = typer.Typer(help="Measured KV-cache memory, throughput and latency of LLM inference engines.",
                  no_args_is_help=True, add_completion=False)
app.command("run")(run.run)
app.command("report")(report.report)
app.command("compare")(compare.compare)
app.command("setup")(setup.setup)
app.command("plan")(plan.plan_command)
app.command("validate")(validate.validate)
app.command("default-bench")(default_bench.default_bench)

if __name__ == "__main__":
    app()
