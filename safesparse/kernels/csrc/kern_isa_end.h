/* Ends one instruction set's mapping (simd_*.h): undefines the macros it defines for all its
   dtypes (its target attribute and tile sizes); each dtype's own end with kern_dtype_end.h. */
#undef TARGET
#undef RT_PROD
#undef RT_OUT1
#undef RT_OUT2
#undef RT_DOT
#undef CT_DOT
#undef BM_NB
