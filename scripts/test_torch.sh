#!/usr/bin/env bash
# `make test-torch`: the runner's own tests (tests/runner) against other torch releases than the one the project pins
# (torch 2.13.0), each in a throwaway venv under ${TORCHELASTIC_TORCH_VENVS:-/tmp}. Not part of `make test`: the
# releases are CUDA builds of several GB here. The venv holds only that torch (and what it pulls in); everything else
# (Airflow, pytest, this package) comes from the project's .venv, added after it with site.addsitedir.
#
# Usage: bash scripts/test_torch.sh [VERSION ...]   (default: 2.14.1 2.15.0). Prints one table row per version for
# the README's "torch versions" table.
set -uo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.14.1 2.15.0)
root=${TORCHELASTIC_TORCH_VENVS:-/tmp}
main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rows=()
status=0
for version in "${versions[@]}"; do
    venv="$root/torchelastic-torch-$version"
    echo "==> torch $version in $venv"
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
        rm -rf "$venv"
        .venv/bin/python -m venv "$venv" || exit 1
        # A machine-wide constraint may cap torch below the release asked for; this venv asks for exactly one.
        PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install --quiet "torch==$version" || { rows+=("| $version | not installable |"); status=1; continue; }
    fi
    own_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$main_site')" > "$own_site/zz_torchelastic_main_venv.pth"
    found=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
    started=$SECONDS
    # Plain asserts: rewritten ones make a function the tests ship by value reference pygments' lazy modules
    # (cannot pickle '_automodule' object) when pytest comes from the project's venv through site.addsitedir.
    if "$venv/bin/python" -m pytest -p no:cacheprovider -q -n 2 --assert=plain tests/runner; then
        rows+=("| $found | passed ($((SECONDS - started)) s) |")
    else
        rows+=("| $found | FAILED: see the output above |")
        status=1
    fi
done
echo "==> tests/runner against other torch releases"
echo "| torch | tests/runner |"
echo "|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
