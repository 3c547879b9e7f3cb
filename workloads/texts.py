"""Natural text for the kv_quant workload's teacher-forced prompts: real prose, installed offline once.

The text is the Book of Genesis of the King James Version (1611), from Debian's ``bible-kjv-text``
package (the Bible Retrieval System's KJV data, version 4.38), printed by the same package set's ``bible``
program (``bible-kjv``). Its copyright note says the KJV's copyright "is expired since the translation
was done in 1611": it is in the public domain everywhere except the United Kingdom, where the Crown's
letters patent still restrict printing it (docs/kv-quant.md says so beside the figures). Installed with
``apt-get download`` and ``dpkg -x`` into kvbench's environment cache (no root, nothing installed
system-wide); the verses are joined into one paragraph per chapter, the verse numbers and chapter headings
dropped.

What it shows that seeded plain-word prompts cannot: a model reading real language is confident (its
next-token distributions are peaked), so a quantised cache's error shows as a few flipped choices and a
change of perplexity; on random word sequences the distributions are flat, every small error can flip the
greedy token, and perplexity means nothing.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from kvbench.common.envs import InstallStep, Recipe, ensure_env

KJV_VERSION = "4.38"  # Debian's bible-kjv-text / bible-kjv
KJV_FILE = "kjv-genesis.txt"
KJV_ORIGIN = (f"the Book of Genesis, King James Version (1611), from Debian's bible-kjv-text {KJV_VERSION} "
              "(public domain; Crown copyright in the UK)")

_INSTALL = r"""
set -euo pipefail
out="$1"; version="$2"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get download "bible-kjv-text=$version" "bible-kjv=$version" || apt-get download bible-kjv-text bible-kjv
for deb in *.deb; do dpkg -x "$deb" root; done
cp root/usr/share/doc/bible-kjv-text/copyright "$out/COPYRIGHT"
root/usr/bin/bible -p root/usr/lib -l 100000 Gen1:1-50:26 > "$out/genesis.raw"
ls *.deb > "$out/PACKAGES"
"""


def recipe() -> Recipe:
    step = InstallStep(("bash", "-c", _INSTALL, "install_kjv", "{env}", KJV_VERSION))
    return Recipe("text-kjv", KJV_VERSION, (step,), venv=False)


def paragraphs(raw: str) -> str:
    """``bible``'s output as prose: a chapter's verses joined into one paragraph, numbers and headings dropped."""
    chapters, verses = [], []
    for line in raw.splitlines():
        m = re.match(r"^\s+\d+ (.*\S)\s*$", line)
        if m:
            verses.append(m.group(1))
        elif line.strip() and verses:  # the next chapter's heading
            chapters.append(" ".join(verses))
            verses = []
    if verses:
        chapters.append(" ".join(verses))
    return "\n\n".join(chapters)


@lru_cache(maxsize=None)
def kjv_genesis(log=print) -> str:
    """The natural text, installed once (``apt-get download``: the Debian archive must be reachable then)."""
    env = ensure_env(recipe(), log=log)
    text = paragraphs((Path(env) / "genesis.raw").read_text(encoding="utf-8", errors="replace"))
    if len(text) < 100_000:
        raise RuntimeError(f"the KJV text in {env} is too short ({len(text)} characters): reinstall it")
    return text
