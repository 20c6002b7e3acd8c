// The ```ts blocks of README.md, in order, with the heading each is under.
// Shared by check-readme.js (type-checks them all) and check-install.js
// (compiles and runs the quick start from a packed tarball).
'use strict';
const fs = require('node:fs');
const path = require('node:path');

function readmeBlocks(readme = path.resolve(__dirname, '..', 'README.md')) {
  const blocks = [];
  let heading = '';
  let current = null;
  for (const [index, line] of fs.readFileSync(readme, 'utf8').split('\n').entries()) {
    if (current) {
      if (line.startsWith('```')) {
        blocks.push(current);
        current = null;
      } else current.code.push(line);
    } else if (/^#{1,6} /.test(line)) heading = line.replace(/^#+ /, '');
    else if (/^```ts\s*$/.test(line)) current = { heading, line: index + 1, code: [] };
  }
  return blocks.map((block) => ({ ...block, code: block.code.join('\n') + '\n' }));
}

module.exports = { readmeBlocks };
