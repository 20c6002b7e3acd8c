#!/usr/bin/env node
// Build step: copies the contract from <repo>/proto into ./proto (shipped
// with the package and loaded at run time by @grpc/proto-loader) and
// generates TypeScript types for it into src/generated with
// proto-loader-gen-types. Neither output is committed.
'use strict';
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');

const here = path.resolve(__dirname, '..');
const candidates = [
  process.env.RETRYD_PROTO_ROOT,
  path.resolve(here, '..', '..', 'proto'),
  path.join(here, 'proto'),
].filter(Boolean);
const protoFile = path.join('retryd', 'v1', 'retryd.proto');
const root = candidates.find((dir) => fs.existsSync(path.join(dir, protoFile)));
if (!root) {
  console.error(`generate: cannot find ${protoFile} in ${candidates.join(', ')} (set RETRYD_PROTO_ROOT)`);
  process.exit(1);
}

const shipped = path.join(here, 'proto');
if (path.resolve(root) !== path.resolve(shipped)) {
  fs.rmSync(shipped, { recursive: true, force: true });
  fs.mkdirSync(path.dirname(path.join(shipped, protoFile)), { recursive: true });
  fs.copyFileSync(path.join(root, protoFile), path.join(shipped, protoFile));
}

const generated = path.join(here, 'src', 'generated');
fs.rmSync(generated, { recursive: true, force: true });
// These options must match LOADER_OPTIONS in src/proto.ts.
execFileSync(
  process.execPath,
  [
    require.resolve('@grpc/proto-loader/build/bin/proto-loader-gen-types.js'),
    '--grpcLib=@grpc/grpc-js',
    '--longs=Number',
    '--enums=String',
    '--defaults',
    '--oneofs',
    `--includeDirs=${shipped}`,
    `--outDir=${generated}`,
    protoFile,
  ],
  { stdio: 'inherit', cwd: here },
);
