#!/usr/bin/env bash
# Generate the Python code of every proto under protos/ (the only way it is made; never
# edit the *_pb2*.py files by hand). Needs grpcio-tools; the generated modules import with
# plain grpcio + protobuf. Run from anywhere: paths are resolved from the repository root.
# Imports resolve as `protos.picovllm.<service>.v1.<service>_pb2`, since -I is the root.
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t files < <(find protos -name '*.proto' | sort)
python3 -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. "${files[@]}"

# Every directory on the way down is a regular package.
for f in "${files[@]}"; do
  d=$(dirname "$f")
  while [ "$d" != "." ]; do
    [ -f "$d/__init__.py" ] || : >"$d/__init__.py"
    d=$(dirname "$d")
  done
done
echo "generated: ${files[*]}"
