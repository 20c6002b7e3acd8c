/**
 * Loads the retryd.v1 contract at run time with @grpc/proto-loader. The
 * .proto file is copied next to the package by the build (tools/generate.js),
 * and the TypeScript types in ./generated are produced from the same file by
 * proto-loader-gen-types with the same options, so the two cannot disagree.
 */
import * as path from 'node:path';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import type { ProtoGrpcType } from './generated/retryd';

/** Must match the flags in tools/generate.js. */
export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: false,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
};

/** <package>/proto, from dist/src at run time. */
export const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');

let loaded: ProtoGrpcType | undefined;
let definition: protoLoader.PackageDefinition | undefined;

export function packageDefinition(): protoLoader.PackageDefinition {
  definition ??= protoLoader.loadSync(path.join('retryd', 'v1', 'retryd.proto'), {
    ...LOADER_OPTIONS,
    includeDirs: [PROTO_ROOT],
  });
  return definition;
}

export function proto(): ProtoGrpcType {
  loaded ??= grpc.loadPackageDefinition(packageDefinition()) as unknown as ProtoGrpcType;
  return loaded;
}
