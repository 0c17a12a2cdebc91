"""Writes a Hub-ready `custom_generate` repository for hf_bole: `README.md` (this folder's, with the model card's
`custom_generate` tag and the sections transformers' docs ask for) and `custom_generate/generate.py` and
`requirements.txt`. Push the folder to the Hub as a model repository, then
`model.generate(..., custom_generate="<user>/<repo>", trust_remote_code=True)`; a local copy works the same way
(`custom_generate="<folder>"`).

    python custom_generate/export.py /tmp/hf_bole_hub --repo-id <user>/hf_bole
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("generate.py", "requirements.txt")  # what transformers reads from the repository's custom_generate/
PLACEHOLDER = "<this repo>"  # the README's example names the repository by this until export names it


def export(out: str | Path, repo_id: str | None = None) -> Path:
    """The repository in `out` (created; files there of the same names replaced). `repo_id` goes into the README's
    example in place of `<this repo>`."""
    out = Path(out)
    (out / "custom_generate").mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(HERE / name, out / "custom_generate" / name)
    readme = (HERE / "README.md").read_text()
    if PLACEHOLDER not in readme:
        raise ValueError(f"{HERE / 'README.md'} lost its {PLACEHOLDER!r} placeholder in the example")
    (out / "README.md").write_text(readme.replace(PLACEHOLDER, repo_id or PLACEHOLDER))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the folder to write the repository into")
    ap.add_argument("--repo-id", help="the Hub id the README's example loads (default: left as <this repo>)")
    args = ap.parse_args(argv)
    print(f"wrote {export(args.out, args.repo_id)}")


if __name__ == "__main__":
    main()
