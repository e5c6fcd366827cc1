#!/usr/bin/env bash
# Checks that every tracked C++ file is formatted as .clang-format says
# (clang-format 14, Debian 12's). Prints each file that is not and exits 1;
# changes nothing. To fix a file: clang-format-14 -i FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
fmt=$(command -v clang-format-14 || command -v clang-format || true)
if [ -z "$fmt" ]; then
  echo "check_format: clang-format not found (scripts/install-deps.sh installs it)" >&2
  exit 1
fi
"$fmt" --version
bad=()
while IFS= read -r f; do
  "$fmt" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done < <(git ls-files '*.cc' '*.h')
if ((${#bad[@]})); then
  printf 'not formatted (clang-format -i FILE): %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format: $(git ls-files '*.cc' '*.h' | wc -l) files formatted"
