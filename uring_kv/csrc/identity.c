/* The benches' check of the identity pattern (uring_kv/bench/workload.py): word w of the row that holds
 * key d must be d << 32 | w. One pass over the rows, in C with the GIL released: on a 2-core machine the
 * numpy form (a temporary the size of the rows, then a comparison) took a third of a core away from the
 * methods being measured in bench-mix, whose every load is checked. */
#include "ukv.h"

/* Whether `rows` rows of `row_words` words at `words` hold the pattern of keys `numbers` (row i: key
 * numbers[i]); with `scrub`, every word is then set to all ones, in the same pass, so that a later load
 * that leaves a row untouched is caught. Returns 1 (all hold) or 0. */
int ukv_check_identity(uint64_t *words, uint64_t rows, uint64_t row_words, const int64_t *numbers, int scrub) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i < rows; i++) {
        uint64_t *row = words + i * row_words;
        uint64_t high = (uint64_t)numbers[i] << 32;
        if (scrub) {
            for (uint64_t w = 0; w < row_words; w++) {
                bad |= row[w] ^ (high | w);
                row[w] = UINT64_MAX;
            }
        } else {
            for (uint64_t w = 0; w < row_words; w++) bad |= row[w] ^ (high | w);
        }
    }
    return bad == 0;
}
