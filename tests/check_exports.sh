#!/bin/sh
# The shared library exports exactly the functions the header declares.
# usage: check_exports.sh libweight_manager.so weight_manager.h
set -eu
lib=$1 header=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nm -D --defined-only "$lib" | awk 'NF == 3 {print $3}' | sed 's/@.*//' | sort -u > "$tmp/exported"
grep -v '^typedef' "$header" | grep -v '^ ' | grep -v '^//' \
  | grep -o 'wm_[a-z_0-9]*(' | tr -d '(' | sort -u > "$tmp/declared"
if ! cmp -s "$tmp/exported" "$tmp/declared"; then
  echo "exported symbols differ from the header's functions"
  echo "only exported:"; comm -23 "$tmp/exported" "$tmp/declared"
  echo "only declared:"; comm -13 "$tmp/exported" "$tmp/declared"
  exit 1
fi
echo "ok: $(wc -l < "$tmp/exported") exported symbols, all wm_ functions declared in the header"
