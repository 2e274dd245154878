/* The AMX tile instructions as inline asm whose operands name exactly the memory each reads or
 * writes. Every AMX kernel in engine/csrc uses these, never <immintrin.h>'s `_tile_*` (a test,
 * tests/test_kernel_builds.py, keeps those out and checks the assembly made of these), because
 * under GCC 12:
 *   _tile_loadconfig's "m" operand covers a pointer's 8 bytes of the 64-byte config, so GCC may
 *     drop the stores that fill the rest: where the config was built in a function called through
 *     a pointer it did, and ldtilecfg raised #GP, a SIGSEGV that took the prefill worker down;
 *   _tile_loadd passes its address in a register and names no memory, so GCC may delete a store
 *     that only a tile load reads, or sink it past the load;
 *   _tile_stored clobbers all memory, which is safe but makes GCC reload everything after it.
 * Here ldtilecfg reads the whole config ("m"); a tile load reads its 16 rows as one "m" operand
 * spanning them; a tile store updates them ("+m": the bytes between the rows keep their values).
 * The instructions without memory (tilezero, tdpbf16ps, tilerelease) are volatile, like the loads
 * and stores, so GCC keeps them all in program order.
 *
 * Every tile the kernels configure has AMX_TILE_ROWS rows of AMX_TILE_ROW_BYTES bytes, the most a
 * tile holds; loads and stores move whole tiles of that shape, their rows `stride` (>= 64) bytes
 * apart. Tile numbers are part of the instruction, so the wrappers that take one are macros. */
#ifndef PDSERVE_AMX_TILES_H
#define PDSERVE_AMX_TILES_H

#include <stdint.h>

#define AMX_TILE_ROWS 16
#define AMX_TILE_ROW_BYTES 64

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;
_Static_assert(sizeof(amx_tile_config) == 64, "ldtilecfg reads 64 bytes");

/* Loads the tile configuration (ldtilecfg): all 64 bytes of it are an input. */
static inline void amx_load_config(const amx_tile_config *config) {
    __asm__ volatile("ldtilecfg\t%X0" : : "m"(*config));
}

/* Returns the tiles to their initial state (tilerelease). */
static inline void amx_release(void) { __asm__ volatile("tilerelease" : :); }

/* The bytes a whole tile spans from `base`, its rows `stride` bytes apart, as an lvalue of a char
 * array type (char: it aliases whatever the rows hold); a variably sized one where `stride` is not
 * a constant. */
#define AMX_TILE_SPAN(qualifier, base, stride)                                                     \
    (*(qualifier char(*)[(AMX_TILE_ROWS - 1) * (stride) + AMX_TILE_ROW_BYTES])(base))

/* tmm`tile` = the tile at `base`, rows `stride` bytes apart (tileloadd). */
#define amx_tile_load(tile, base, stride)                                                          \
    do {                                                                                           \
        const char *amx_base_ = (const char *)(base);                                              \
        const int64_t amx_stride_ = (int64_t)(stride);                                             \
        __asm__ volatile("{tileloadd\t(%1,%2,1), %%tmm" #tile "|tileloadd\t%%tmm" #tile            \
                         ", [%1+%2*1]}"                                                            \
                         :                                                                         \
                         : "m"(AMX_TILE_SPAN(const, amx_base_, amx_stride_)), "r"(amx_base_),      \
                           "r"(amx_stride_));                                                      \
    } while (0)

/* The tile at `base`, rows `stride` bytes apart, = tmm`tile` (tilestored). */
#define amx_tile_store(tile, base, stride)                                                         \
    do {                                                                                           \
        char *amx_base_ = (char *)(base);                                                          \
        const int64_t amx_stride_ = (int64_t)(stride);                                             \
        __asm__ volatile("{tilestored\t%%tmm" #tile ", (%1,%2,1)|tilestored\t[%1+%2*1], %%tmm"     \
                         #tile "}"                                                                 \
                         : "+m"(AMX_TILE_SPAN(, amx_base_, amx_stride_))                           \
                         : "r"(amx_base_), "r"(amx_stride_));                                      \
    } while (0)

/* tmm`tile` = 0 (tilezero). */
#define amx_tile_zero(tile) __asm__ volatile("tilezero\t%%tmm" #tile : :)

/* tmm`acc` += tmm`a` . tmm`b`, bf16 pairs into fp32 (tdpbf16ps; `b` in the VNNI layout). */
#define amx_dpbf16ps(acc, a, b)                                                                    \
    __asm__ volatile("{tdpbf16ps\t%%tmm" #b ", %%tmm" #a ", %%tmm" #acc "|tdpbf16ps\t%%tmm" #acc   \
                     ", %%tmm" #a ", %%tmm" #b "}" : :)

#endif
