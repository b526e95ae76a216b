# Sourced by the staging scripts (tools/stage_ort_xz.sh, tools/stage_device.sh): cut a stream into parts that each
# fit one device call. split_parts SIZE PREFIX NAME < stream: PREFIX0, PREFIX1, ... each holding one NAME.partNN;
# sets PARTS to their count.
split_parts() {
  local size=$1 prefix=$2 name=$3 tmp="${2}tmp" f
  rm -rf "$prefix"[0-9]* "$tmp" && mkdir -p "$tmp"
  split -b "$size" -d - "$tmp/$name.part"
  PARTS=0
  for f in "$tmp/$name".part*; do mkdir -p "$prefix$PARTS" && mv "$f" "$prefix$PARTS/"; PARTS=$((PARTS + 1)); done
  rmdir "$tmp"
}

# print_calls PREFIX FIRST LAST DEST: the device calls that carry PREFIX<FIRST> .. PREFIX<LAST> and copy each into
# DEST on the device machine, numbered from FIRST + 1.
print_calls() {
  local prefix=$1 first=$2 last=$3 dest=$4 i
  for i in $(seq "$first" "$last"); do
    echo "call $((i + 1)): carry [\"$prefix$i\"]  command: mkdir -p $dest && cp $prefix$i/* $dest/"
  done
}
