module github.com/retryd/retryd/clients/go

// The oldest versions this module is built and tested with: those of Debian
// 12's golang-go, golang-google-grpc-dev and golang-google-protobuf-dev (and
// of grpc's own dependencies there). A newer toolchain or newer modules are
// fine; go.sum is left to the depending module.
go 1.19

require (
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)

require (
	github.com/golang/protobuf v1.3.5 // indirect
	golang.org/x/net v0.7.0 // indirect
	golang.org/x/sys v0.3.0 // indirect
	golang.org/x/text v0.7.0 // indirect
	google.golang.org/genproto v0.0.0-20200413115906-b5235f65be36 // indirect
)
