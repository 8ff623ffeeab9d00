#!/bin/sh
# Installs the library into a fresh prefix with `cmake --install`, then builds
# a C consumer with nothing but `pkg-config --cflags --libs weight_manager`
# (PKG_CONFIG_PATH pointing at the prefix) and runs it, linked to the shared
# library (found through LD_LIBRARY_PATH: the .pc carries no rpath, as usual)
# and to the static one (Libs.private must be enough).
# usage: run.sh SOURCE_DIR WORK_DIR CARGO_TARGET_DIR
set -eu
src=$1 work=$2 cargo_target=$3
here=$(cd "$(dirname "$0")" && pwd)
command -v pkg-config >/dev/null || { echo "pkgconfig consumer: pkg-config is not installed (scripts/setup.sh installs it)" >&2; exit 1; }
cc=${CC:-cc}
rm -rf "$work"
mkdir -p "$work"
prefix="$work/prefix"
cmake -S "$src" -B "$work/lib" -DWM_BUILD_TESTS=OFF -DWM_CARGO_TARGET_DIR="$cargo_target" \
  -DCMAKE_INSTALL_PREFIX="$work/configured-prefix" > "$work/lib.log"
cmake --build "$work/lib" > "$work/lib-build.log"
# --prefix differs from the configured one: the .pc must follow the files.
cmake --install "$work/lib" --prefix "$prefix" > "$work/install.log"

pc=$(find "$prefix" -name weight_manager.pc)
[ -n "$pc" ] || { echo "pkgconfig consumer: cmake --install wrote no weight_manager.pc under $prefix" >&2; exit 1; }
PKG_CONFIG_PATH=$(dirname "$pc")
export PKG_CONFIG_PATH
version=$(sed -n 's/^project(weight_manager VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")
[ "$(pkg-config --modversion weight_manager)" = "$version" ] || {
  echo "pkgconfig consumer: .pc version $(pkg-config --modversion weight_manager), project $version" >&2; exit 1; }

# Shared: the exact line an engine's Makefile would use.
# shellcheck disable=SC2046
"$cc" -Wall -Wextra -Werror -std=c11 "$here/consumer.c" -o "$work/consumer" $(pkg-config --cflags --libs weight_manager)
libdir=$(pkg-config --variable=libdir weight_manager)
LD_LIBRARY_PATH="$libdir" "$work/consumer" "$version"

# Static: the archive, then what pkg-config --static adds for it.
private=$(pkg-config --static --libs-only-l weight_manager | tr ' ' '\n' | grep -vx -e -lweight_manager -e '' | tr '\n' ' ')
# shellcheck disable=SC2046,SC2086
"$cc" -Wall -Wextra -Werror -std=c11 "$here/consumer.c" -o "$work/consumer_static" $(pkg-config --cflags weight_manager) \
  "$libdir/libweight_manager.a" $private
if readelf -d "$work/consumer_static" | grep -q 'libweight_manager\.so'; then
  echo "pkgconfig consumer: the static consumer still needs libweight_manager.so" >&2; exit 1
fi
"$work/consumer_static" "$version"
