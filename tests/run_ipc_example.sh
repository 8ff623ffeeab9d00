#!/bin/sh
# Runs c_examples/trainer_ipc and c_examples/engine_ipc against each other.
# usage: run_ipc_example.sh TRAINER ENGINE WORKDIR
set -eu
trainer=$1 engine=$2 work=$3
mkdir -p "$work"
sock="$work/trainer_ipc.sock"
rm -f "$sock"
"$trainer" "$sock" &
tpid=$!
"$engine" "$sock"
wait "$tpid"
