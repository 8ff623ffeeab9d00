#!/bin/sh
# Configure, build and run the consumer project.
# usage: run.sh add_subdirectory|find_package SOURCE_DIR WORK_DIR CARGO_TARGET_DIR
set -eu
mode=$1 src=$2 work=$3 cargo_target=$4
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
mkdir -p "$work"
if [ "$mode" = find_package ]; then
  cmake -S "$src" -B "$work/lib" -DWM_BUILD_TESTS=OFF -DWM_CARGO_TARGET_DIR="$cargo_target" \
    -DCMAKE_INSTALL_PREFIX="$work/prefix" > "$work/lib.log"
  cmake --build "$work/lib" > "$work/lib-build.log"
  cmake --install "$work/lib" > "$work/install.log"
  cmake -S "$here" -B "$work/app" -DWM_MODE=find_package -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/app.log"
else
  cmake -S "$here" -B "$work/app" -DWM_MODE=add_subdirectory -DWM_SOURCE_DIR="$src" \
    -DWM_CARGO_TARGET_DIR="$cargo_target" > "$work/app.log"
fi
cmake --build "$work/app" > "$work/app-build.log"
"$work/app/consumer"
"$work/app/consumer_static"
