#!/usr/bin/env bash
# At most 8 files (2 folders down) come back from a device call's $OUT: keep the files that
# match the given patterns (paths relative to $OUT, shell globs; at most 7 files in all) and
# put every other file into $OUT/rest.tgz.
#   bash scripts/lab/gpu_pack.sh summary.txt 'layer_n8.*' bisect.md
set -euo pipefail
cd "${OUT:?set OUT}"
rest=()
while IFS= read -r f; do
  keep=0
  for pattern in "$@"; do
    # shellcheck disable=SC2053  # the pattern is a glob on purpose
    [[ $f == $pattern ]] && keep=1
  done
  [ "$keep" = 1 ] || rest+=("$f")
done < <(find . -type f ! -path ./rest.tgz | sed 's|^\./||' | sort)
if [ ${#rest[@]} -gt 0 ]; then
  tar czf rest.tgz --remove-files "${rest[@]}"
fi
find . -mindepth 1 -type d -empty -delete
n=$(find . -type f | wc -l)
echo "gpu_pack: $n files in $OUT (${#rest[@]} packed into rest.tgz)"
[ "$n" -le 8 ] || echo "gpu_pack: more than 8 files: keep fewer" >&2
