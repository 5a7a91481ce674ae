#!/usr/bin/env bash
# Draws bench_mc2 --sweep's CSV: per op and shape, time / T_compute against
# r = T_comm_min / T_compute, for the fused op (the chunk count that ran fastest at each rate),
# the unfused path, the ideal max(1, r) and the serial sum 1 + r. Needs gnuplot (gnuplot-nox).
#   bash bench/plot_sweep.sh sweep.csv docs/img/mc2_sweep.png
set -euo pipefail
csv=${1:?usage: plot_sweep.sh CSV PNG}
png=${2:?usage: plot_sweep.sh CSV PNG}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# One file per op/shape: r, fused/compute (best chunk count), unfused/compute, sorted by r.
panels=()
while IFS= read -r key; do
  file="$work/${key//,/_}.dat"
  awk -F, -v key="$key" 'NR > 1 && $1 "," $2 == key {
      k = $8; f = $19 / $10; u = $16 / $10
      if (!(k in best) || f < best[k]) { best[k] = f; unf[k] = u }
    } END { for (k in best) print k, best[k], unf[k] }' "$csv" | sort -g >"$file"
  panels+=("$key")
done < <(awk -F, 'NR > 1 { print $1 "," $2 }' "$csv" | awk '!seen[$0]++')
n=${#panels[@]}
cols=2
rows=$(((n + cols - 1) / cols))
{
  echo "set terminal pngcairo size 1200,$((380 * rows)) font 'sans,10' noenhanced"
  echo "set output '$png'"
  echo "set multiplot layout $rows,$cols title 'MC2 on 2 ranks, bf16: time / T_compute against r = T_comm_min / T_compute (veth + tc tbf, rate swept)'"
  echo "set logscale x 2; set xrange [0.2:5]; set yrange [0:*]; set key top left; set grid"
  echo "set xlabel 'r'; set ylabel 'time / T_compute'"
  for key in "${panels[@]}"; do
    file="$work/${key//,/_}.dat"
    echo "set title '${key/,/ · }'"
    echo "plot '$file' using 1:2 with linespoints lw 2 title 'fused (MC2)', \\"
    echo "     '$file' using 1:3 with linespoints lw 2 title 'unfused', \\"
    echo "     (x < 1 ? 1 : x) with lines dt 2 lc rgb 'black' title 'ideal max(1, r)', \\"
    echo "     1 + x with lines dt 3 lc rgb 'gray40' title 'serial 1 + r'"
  done
  echo "unset multiplot"
} >"$work/plot.gp"
gnuplot "$work/plot.gp"
echo "plot_sweep: wrote $png ($n panels)"
