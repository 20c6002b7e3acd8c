#!/bin/sh
# Redis CPU per exact decision: the exact store's decision script
# (bucket.lua + check.lua, as CHECK_SOURCE) run by redis-benchmark against
# one redis-server; reports calls/s, commandstats usec per call and
# redis-server CPU per call. Usage: scripts/redis_commandstats.sh DIR_WITH_THE_LUA_FILES FREE_PORT
# (e.g. crates/retryd-budget/src/redis 46002). It runs one hot upstream
# unpipelined from one client, then 50 clients pipelining 16, and shuts
# the server down.
set -e
dir=$1; port=$2
redis-server --port $port --save "" --appendonly no --daemonize yes --logfile /tmp/redis-commandstats-$port.log
sleep 0.5
src=$(cat $dir/bucket.lua; echo; cat $dir/check.lua)
sha=$(redis-cli -p $port SCRIPT LOAD "$src")
run() { # clients pipeline requests
  redis-cli -p $port CONFIG RESETSTAT >/dev/null
  cpu0=$(redis-cli -p $port INFO cpu | awk -F: '/used_cpu_(user|sys):/{s+=$2} END{printf "%.6f", s}')
  out=$(redis-benchmark -p $port -n $3 -c $1 -P $2 -q EVALSHA $sha 3 "b:{u:x}:bucket" "b:{u:x}:off" "b:{u:x}:leases" 1000000000000000 1000000000000000 0.00001 60000 1 2>&1 | tr "\r" "\n" | tail -1 | sed "s/.*: \([0-9.]* requests per second\)/\1/")
  cpu1=$(redis-cli -p $port INFO cpu | awk -F: '/used_cpu_(user|sys):/{s+=$2} END{printf "%.6f", s}')
  stats=$(redis-cli -p $port INFO commandstats | tr -d '\r')
  calls=$(echo "$stats" | awk -F'[=,:]' '/cmdstat_evalsha/{print $3}')
  usec=$(echo "$stats" | awk -F'[=,:]' '/cmdstat_evalsha/{print $5}')
  total=$(echo "$stats" | awk -F'[=,]' '/cmdstat_/{split($0,a,"calls=");split(a[2],b,",");s+=b[1]} END{print s}')
  echo "c=$1 P=$2: $out | evalsha calls $calls, commands/call $(echo "$total $calls" | awk '{printf "%.2f", ($1-2)/$2}'), script usec/call $(echo "$usec $calls" | awk '{printf "%.2f", $1/$2}'), server CPU usec/call $(echo "$cpu0 $cpu1 $calls" | awk '{printf "%.2f", ($2-$1)*1e6/$3}')"
}
run 1 1 20000
run 50 16 400000
redis-cli -p $port SHUTDOWN NOSAVE >/dev/null 2>&1 || true
