/* Ends one dtype's instantiation of kern.h: undefines the macros blockprod.c defines per
   instruction set and dtype (the instruction set's own: TARGET, the tile sizes, are undefined
   where its last dtype ends). Included after each #include "kern.h". */
#undef SUF
#undef R
#undef VT
#undef W
#undef MT
#undef MASK
#undef LOADU
#undef LOADM
#undef STOREU
#undef STOREM
#undef SET1
#undef ZERO
#undef FMA
#undef ADD
#undef HSUM
#undef DT_SELF
#undef ROWSUMS
#undef TRANSPOSE_W
