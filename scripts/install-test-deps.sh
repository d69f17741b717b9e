#!/usr/bin/env bash
# The real programs the tests talk to, for `make test` and CI (.ci/run) alike:
#   Debian's prometheus (the server; its package brings promtool), chromium + chromium-driver
#   (browser tests of the dashboards), and SGLang 0.5.23's wheel (read, never installed or
#   imported, by the SGLang-format tests).
# Installs what is missing when it can (root, or passwordless sudo for apt-get), then prints
# what is present and what is not, with the tests that will skip for each. --strict (CI):
# exit 1 when anything is still missing.
set -uo pipefail
cd "$(dirname "$0")/.."
strict=0
[ "${1:-}" = "--strict" ] && strict=1
PY="${PY:-python3}"
WHEELS="${DSPARK_OBS_CACHE:-$HOME/.cache/dspark-obs}/wheels"
SGLANG_WHEEL_GLOB="$WHEELS/sglang-0.5.23-*.whl"

declare -A need=(
  [prometheus]="prometheus"   # program -> Debian package
  [promtool]="prometheus"
  [chromium]="chromium"
  [chromedriver]="chromium-driver"
)
declare -A skips=(
  [prometheus]="test_prometheus_e2e, test_grafana (PromQL against a real server)"
  [promtool]="test_prometheus_rules (promtool check/test rules), test_compose config check"
  [chromium]="test_dashboard_browser (pages in a real browser), dashboard screenshots"
  [chromedriver]="test_dashboard_browser"
  [sglang-wheel]="the SGLang-format tests (payloads built by SGLang's own code)"
)

missing_pkgs() {
  local p pkgs=()
  for p in "${!need[@]}"; do
    command -v "$p" >/dev/null 2>&1 || pkgs+=("${need[$p]}")
  done
  printf '%s\n' "${pkgs[@]}" | sort -u | tr '\n' ' '
}

pkgs="$(missing_pkgs)"
if [ -n "${pkgs// /}" ]; then
  if [ "$(id -u)" = 0 ]; then apt=(apt-get); elif sudo -n true 2>/dev/null; then apt=(sudo -n apt-get)
  else apt=(); fi
  if [ ${#apt[@]} -gt 0 ]; then
    echo "installing Debian packages: $pkgs"
    export DEBIAN_FRONTEND=noninteractive
    "${apt[@]}" update -q >/dev/null && "${apt[@]}" install -y -q --no-install-recommends $pkgs \
      >/dev/null || echo "apt-get could not install: $pkgs"
  else
    echo "cannot install $pkgs: not root and no passwordless sudo" \
         "(run: sudo apt-get install --no-install-recommends $pkgs)"
  fi
fi

if ! ls $SGLANG_WHEEL_GLOB >/dev/null 2>&1; then
  mkdir -p "$WHEELS"
  echo "downloading the sglang==0.5.23 wheel into $WHEELS (read by tests, never installed)"
  "$PY" -m pip download -q --no-deps --disable-pip-version-check -d "$WHEELS" sglang==0.5.23 \
    || echo "pip could not download sglang==0.5.23"
fi

absent=0
echo "test dependencies:"
for p in prometheus promtool chromium chromedriver; do
  if command -v "$p" >/dev/null 2>&1; then
    echo "  ok       $p ($(command -v "$p"))"
  else
    echo "  MISSING  $p (Debian package ${need[$p]}): skips ${skips[$p]}"
    absent=1
  fi
done
if ls $SGLANG_WHEEL_GLOB >/dev/null 2>&1; then
  echo "  ok       sglang wheel ($(ls $SGLANG_WHEEL_GLOB | head -1))"
else
  echo "  MISSING  sglang wheel ($WHEELS): skips ${skips[sglang-wheel]}"
  absent=1
fi
if [ "$absent" = 1 ] && [ "$strict" = 1 ]; then
  echo "missing test dependencies (--strict): failing" >&2
  exit 1
fi
exit 0
