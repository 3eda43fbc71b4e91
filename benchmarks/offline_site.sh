# Sourced by gpu_check.sh and gpu_bench.sh (from the repository root): the wheels of what a GPU machine without
# network lacks, installed with pip --no-index into a site folder that goes onto PYTHONPATH after this working tree.
# GPU_SITE names that folder; by default it is a fresh private one (mktemp -d), removed by remove_offline_site, so no
# folder another user of the machine could have prepared is ever imported from. With no wheels nothing is put on
# PYTHONPATH but the working tree. $1: what the run lacks without the wheels.
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
OWN_SITE=""
SITE=""
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    if [ -n "${GPU_SITE:-}" ]; then
        SITE=$GPU_SITE
    else
        OWN_SITE=$(mktemp -d -t lightning-fastdist-gpu-site.XXXXXXXX)
        SITE=$OWN_SITE
    fi
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
else
    echo "no wheels in $WHEELS: $1" >&2
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

remove_offline_site() {
    if [ -n "$OWN_SITE" ]; then rm -rf "$OWN_SITE"; fi
}
