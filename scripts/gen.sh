#!/usr/bin/env bash
# Regenerates the Go code for api/ from the protobuf definitions.
# Needs protoc (Debian: protobuf-compiler) and the Go plugins:
#   go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
#   go install connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.19.1
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$(go env GOPATH)/bin:$PATH"
rm -f api/shoal/v1/*.pb.go api/shoal/v1/shoalv1connect/*.go
protoc -I api -I /usr/include \
  --go_out=. --go_opt=module=github.com/shoal-sandbox/shoal \
  --connect-go_out=. --connect-go_opt=module=github.com/shoal-sandbox/shoal \
  api/shoal/v1/*.proto
