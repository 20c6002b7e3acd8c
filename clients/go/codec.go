package retryd

import (
	"fmt"

	"google.golang.org/protobuf/proto"
)

// protoCodec marshals with google.golang.org/protobuf directly, as grpc-go's
// own "proto" codec does from v1.35 on. Every call of this package forces it,
// so that the generated messages (protoc-gen-go v1.20+ API) work whatever
// version of github.com/golang/protobuf the application links: grpc-go
// v1.33's codec goes through that module, and its v1.3 releases (still what
// some distributions ship) cannot marshal such messages.
type protoCodec struct{}

func (protoCodec) Marshal(v interface{}) ([]byte, error) {
	message, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("retryd: cannot marshal %T: not a protobuf message", v)
	}
	return proto.Marshal(message)
}

func (protoCodec) Unmarshal(data []byte, v interface{}) error {
	message, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("retryd: cannot unmarshal into %T: not a protobuf message", v)
	}
	return proto.Unmarshal(data, message)
}

// Name is the content-subtype: "proto", the standard one, so that any gRPC
// server decodes the messages.
func (protoCodec) Name() string { return "proto" }
