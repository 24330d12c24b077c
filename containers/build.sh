#!/usr/bin/env bash
# containers/build.sh: build the hpcmeg image once per cluster, from containers/hpcmeg.def.
#
#   bash containers/build.sh [OUT_DIR]        # default OUT_DIR: $SCRATCH or ./images
#
# Produces OUT_DIR/hpcmeg.sif (Apptainer, unprivileged: `apptainer build --fakeroot`) and, when
# enroot is installed, OUT_DIR/hpcmeg.sqsh for pyxis (`srun --container-image=OUT_DIR/hpcmeg.sqsh`)
# imported from the same NGC base with the same packages installed. Apptainer's cache and temp
# directories go to scratch, never $HOME (quota) or a small /tmp: the NGC image is ~20 GB unpacked.
# Run it on a node with internet access (a login node); nothing in the image needs internet later.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
OUT=${1:-${SCRATCH:-$REPO/images}}
mkdir -p "$OUT"
export APPTAINER_CACHEDIR=${APPTAINER_CACHEDIR:-$OUT/.apptainer-cache}
export APPTAINER_TMPDIR=${APPTAINER_TMPDIR:-$OUT/.apptainer-tmp}
mkdir -p "$APPTAINER_CACHEDIR" "$APPTAINER_TMPDIR"
BASE=$(awk '/^From:/ {print $2; exit}' "$HERE/hpcmeg.def")

if command -v apptainer >/dev/null 2>&1; then
  # %files paths are relative to the build's working directory: build from the repo root
  (cd "$REPO" && apptainer build --fakeroot --force "$OUT/hpcmeg.sif" containers/hpcmeg.def)
  apptainer test "$OUT/hpcmeg.sif"
  echo "built $OUT/hpcmeg.sif"
else
  echo "apptainer not found: skipping the .sif (module load apptainer?)" >&2
fi

if command -v enroot >/dev/null 2>&1; then
  # the same recipe for pyxis: import the NGC base, run the def file's %post inside, export squashfs
  name=hpcmeg-build-$$
  enroot import -o "$OUT/base.sqsh" "docker://${BASE/\//#}"
  enroot create -n "$name" "$OUT/base.sqsh"
  enroot start --rw -m "$REPO:/opt/hpcmeg/src-ro" "$name" bash -euc '
    mkdir -p /opt/hpcmeg/src && cp -r /opt/hpcmeg/src-ro/pyproject.toml /opt/hpcmeg/src-ro/README.md /opt/hpcmeg/src-ro/hpcmeg /opt/hpcmeg/src/
    '"$(awk '/^%post/{f=1;next} /^%/{f=0} f' "$HERE/hpcmeg.def")"
  enroot export -o "$OUT/hpcmeg.sqsh" "$name"
  enroot remove -f "$name"; rm -f "$OUT/base.sqsh"
  echo "built $OUT/hpcmeg.sqsh (pyxis: --container-image=$OUT/hpcmeg.sqsh; enroot skips %environment: keep the env of hpcmeg/profiles/example-pyxis.yaml)"
else
  echo "enroot not found: skipping the pyxis squashfs" >&2
fi
