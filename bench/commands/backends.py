import json

import typer


def backends(as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
             default_args: bool = typer.Option(False, "--default-args",
                                               help="Print the -b flags of the default engines (what make bench runs).")):
    """List every engine, its default version and its options (-b ENGINE[@VERSION][:KEY=VALUE,...])."""
    from kvbench.backends import DEFAULT_ENGINES, REGISTRY
    from kvbench.backends.options import COMMON, specs_of

    if default_args:
        print(" ".join(f"-b {name}" for name in DEFAULT_ENGINES))
        return

    engines = {name: {"default_version": cls.default_version,
                      "this_machine": cls.machine_build(cls.default_version),
                      "options": {o.name: {"type": o.type_name, "default": o.default, "shown_default": o.shown_default,
                                           "help": o.help} for o in specs_of(cls).values() if o not in COMMON},
                      # the prefix cache: how each request is kept apart, how it is emptied, how hits are said
                      "prefix_cache": {"isolation_field": cls.capabilities.prefix_cache.isolation_field or None,
                                       "reset": cls.capabilities.prefix_cache.reset or None,
                                       "hits_reported": cls.capabilities.prefix_cache.report or None}}
               for name, cls in sorted(REGISTRY.items())}
    if as_json:
        print(json.dumps({"engines": engines, "common_options": {o.name: {"type": o.type_name, "help": o.help}
                                                                 for o in COMMON}}, indent=2))
        return
    lines = ["-b ENGINE[@VERSION][:KEY=VALUE,...], e.g. -b vllm@0.32.0 or -b llamacpp:threads=2,batch_threads=4", ""]
    for name, e in engines.items():
        lines.append(f"{name} (default version {e['default_version']})")
        if e["this_machine"]:
            lines.append(f"  built on this machine: {e['this_machine']}")
        rows = [("option", "type", "default", "meaning")] + [(k, o["type"], o["shown_default"], o["help"])
                                                            for k, o in e["options"].items()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines += ["  " + "  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) + f"  {r[3]}" for r in rows]
        cache = e["prefix_cache"]
        lines += [f"  prefix cache: isolation field {cache['isolation_field'] or 'none'}; "
                  f"reset {cache['reset'] or 'none'}; hits {cache['hits_reported'] or 'not reported'}", ""]
    lines.append("every engine also takes:")
    width = max(len(o.name) for o in COMMON)
    lines += [f"  {o.name:<{width}}  {o.type_name}  {o.help}" for o in COMMON]
    print("\n".join(lines))
