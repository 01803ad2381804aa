#!/usr/bin/env bash
# Puts promtool at $1, taken out of Debian's prometheus package (apt-get download + dpkg-deb: nothing
# is installed and no Prometheus runs). The tests of deploy/monitoring and of /metrics use it.
set -euo pipefail
dest=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get download -qq prometheus >/dev/null 2>&1 \
  || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 && apt-get download -qq prometheus >/dev/null 2>&1; }
cd - >/dev/null
mkdir -p "$(dirname "$dest")"
dpkg-deb --fsys-tarfile "$work"/prometheus_*.deb | tar -xO ./usr/bin/promtool > "$dest.part"
chmod +x "$dest.part"
"$dest.part" --version >/dev/null
mv "$dest.part" "$dest"
echo "promtool: $("$dest" --version 2>&1 | head -1)"
