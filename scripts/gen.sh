#!/usr/bin/env bash
# Regenerates the Go code for api/ from the protobuf definitions.
# Needs protoc (Debian: protobuf-compiler) and the Go plugins:
#   go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
#   go install connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.19.1
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$(go env GOPATH)/bin:$PATH"
MOD=github.com/shoal-sandbox/shoal

# Shoal's own API.
rm -f api/shoal/v1/*.pb.go api/shoal/v1/shoalv1connect/*.go
protoc -I api -I /usr/include \
  --go_out=. --go_opt=module=$MOD \
  --connect-go_out=. --connect-go_opt=module=$MOD \
  api/shoal/v1/*.proto

# E2B's envd protocol (api/e2b/*/*.proto, kept as E2B wrote them: their
# proto packages "process" and "filesystem" are the wire names the e2b SDK
# calls). They carry no go_package option, so the Go packages are mapped
# here.
rm -f api/e2b/*/*.pb.go api/e2b/*/*connect/*.go
E2B_MAP=""
for p in process filesystem; do
  E2B_MAP="$E2B_MAP,M$p/$p.proto=$MOD/api/e2b/$p;$p"
done
E2B_MAP=${E2B_MAP#,}
protoc -I api/e2b -I /usr/include \
  --go_out=. --go_opt=module=$MOD,$E2B_MAP \
  --connect-go_out=. --connect-go_opt=module=$MOD,$E2B_MAP \
  process/process.proto filesystem/filesystem.proto
